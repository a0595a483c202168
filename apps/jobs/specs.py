"""The rules a job spec must meet before it may queue, as pure functions.

Input is the shape-checked spec (the submit serializer's output); output is the
normalised resources, or an ApplicationError whose details name each field by
its path in the spec (`resources.layout.tp`), so a 400 says exactly what to fix.
"""

import math
import posixpath
import re
from dataclasses import dataclass

from apps.fleet.selectors import PoolCapacity
from apps.jobs.models.jobs import ANY_GPU
from apps.tuning import catalogue
from controlplane.errors import ApplicationError
from workers.trainer.config import FLOAT8_MULTIPLE, float8_misfits, tp_allowed
from workers.trainer.presets import PRESETS, ModelShape

OWNED_KINDS = {"owned": ("owned",), "cloud": ("cloud",), "owned_then_cloud": ("owned", "cloud")}

# Precision fp8 (workers/trainer: bf16 with the blocks' linear layers in float8, torchao's
# Float8Linear) multiplies on FP8 tensor cores, compute capability 8.9 and up: of our GPU
# types, Hopper's. A job that may land on another is refused here, not on its nodes.
FP8_GPU_TYPES = ("H100", "H200")

# The most one job may ask for: the submit serializer's bounds and the Submit page's. Past
# them the layout search would spin (it enumerates divisors), so nothing reads larger counts.
MAX_GPUS = 32_768
MAX_NODES = 4_096
MAX_GPUS_PER_NODE = 64
COUNTS_LIMIT = (
    f"A job has at most {MAX_GPUS} GPUs, {MAX_NODES} nodes and {MAX_GPUS_PER_NODE} GPUs per node."
)

# What a job's `env` may not set: NCCL's, PyTorch-NCCL's and the EFA stack's variables go in
# nccl.overrides, where the linter checks them on top of the pool's profile; the dynamic
# loader's and Python's start-up variables would change the code a run starts with; the rest
# the control plane (apps/jobs/dispatch.py, workers/agent/runs.py) and torchrun set per run.
NCCL_ENV_PREFIXES = (*catalogue.COVERED_PREFIXES, *catalogue.PARTLY_COVERED_PREFIXES)
LOADER_ENV_PREFIXES = ("LD_",)
PYTHON_ENV = frozenset({"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE"})
RUN_ENV_PREFIXES = ("CONTROLPLANE_", "TORCHELASTIC_")
RUN_ENV = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
    }
)


def dp_shard_on(*, nodes: int, gpus_per_node: int, dp_replicate: int, tp: int, pp: int) -> int:
    """The FSDP degree of a layout on `nodes` nodes; 0 when the GPUs do not divide.

    With a node range (resources.min_nodes) only the shard degree follows the node count:
    tp and pp split the model and stay as submitted (so they still divide its heads and
    layers, and tp stays within a node), dp_replicate keeps its replicas, and FSDP's
    checkpoints reshard on load whatever the degree. The global batch stays the same, so
    each data-parallel rank takes a larger share of it on fewer nodes.
    """
    dp_shard, rest = divmod(nodes * gpus_per_node, dp_replicate * tp * pp)
    return 0 if rest else dp_shard


@dataclass(frozen=True)
class Resources:
    gpu_type: str
    nodes: int
    gpus_per_node: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    min_nodes: int  # the fewest nodes an attempt may run on: `nodes` without a range

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def fewer_node_counts(self) -> range:
        """The node counts below `nodes` an attempt may run on (none without a range)."""
        return range(self.nodes - 1, self.min_nodes - 1, -1)

    def dp_shard_on(self, nodes: int) -> int:
        return dp_shard_on(
            nodes=nodes,
            gpus_per_node=self.gpus_per_node,
            dp_replicate=self.dp_replicate,
            tp=self.tp,
            pp=self.pp,
        )


class SpecErrors:
    """Collects every problem with a spec, so one 400 lists them all."""

    def __init__(self):
        self.details: dict[str, list[str]] = {}

    def add(self, path: str, message: str) -> None:
        self.details.setdefault(path, []).append(message)

    def raise_if_any(self) -> None:
        if self.details:
            fields = ", ".join(self.details)
            raise ApplicationError(f"Invalid job spec: {fields}.", details=self.details)


def model_shape(trainer: dict) -> ModelShape | None:
    if trainer.get("preset"):
        return PRESETS[trainer["preset"]]
    sizes = trainer.get("model")
    return ModelShape(**sizes) if sizes else None


def eligible_pools(pools: list[PoolCapacity], *, gpu_type: str, where: str) -> list[PoolCapacity]:
    kinds = OWNED_KINDS[where]
    return [p for p in pools if p.kind in kinds and (gpu_type == ANY_GPU or p.gpu_type == gpu_type)]


def pools_holding(
    pools: list[PoolCapacity], *, gpu_type: str, where: str, nodes: int, gpus_per_node: int
) -> list[int]:
    """Ids of the eligible pools whose nodes can hold this gang (now or once burst)."""
    return [
        p.pool_id
        for p in eligible_pools(pools, gpu_type=gpu_type, where=where)
        if p.can_hold(nodes=nodes, gpus_per_node=gpus_per_node)
    ]


def _node_size(pools: list[PoolCapacity]) -> int:
    sizes = [g for p in pools for g, _ in p.node_sizes] + [p.burst_node_gpus for p in pools]
    return max([s for s in sizes if s], default=8)


def resources_from_spec(spec: dict, *, pools: list[PoolCapacity], errors: SpecErrors):
    """GPU count, nodes × GPUs per node and the parallel layout, checked against each other."""
    wanted = spec["resources"]
    where = spec.get("placement", {}).get("where", "owned_then_cloud")
    gpu_type = wanted.get("gpu_type", ANY_GPU)
    candidates = eligible_pools(pools, gpu_type=gpu_type, where=where)
    gpus = wanted.get("gpus")
    nodes = wanted.get("nodes")
    per_node = wanted.get("gpus_per_node")
    node_size = _node_size(candidates or pools)

    if nodes is None and per_node is None:
        if gpus is None:
            errors.add("resources.gpus", "Give gpus, or nodes and gpus_per_node.")
            return None
        # A GPU count below one node's size means one node.
        if gpus <= node_size:
            nodes, per_node = 1, gpus
        elif gpus % node_size == 0:
            nodes, per_node = gpus // node_size, node_size
        else:
            errors.add(
                "resources.gpus",
                f"{gpus} GPUs are not a whole number of {node_size}-GPU nodes; "
                "give nodes and gpus_per_node.",
            )
            return None
    elif nodes is None or per_node is None:
        missing = "nodes" if nodes is None else "gpus_per_node"
        errors.add(f"resources.{missing}", "Give nodes and gpus_per_node together.")
        return None
    if nodes * per_node > MAX_GPUS:
        errors.add("resources", COUNTS_LIMIT)
        return None
    if gpus is not None and gpus != nodes * per_node:
        errors.add(
            "resources.gpus",
            f"{gpus} GPUs is not nodes × gpus_per_node = {nodes} × {per_node} = "
            f"{nodes * per_node}.",
        )

    layout = wanted.get("layout") or {}
    total = nodes * per_node
    dp_replicate = layout.get("dp_replicate", 1)
    tp = layout.get("tp", 1)
    pp = layout.get("pp", 1)
    dp_shard = layout.get("dp_shard")
    if dp_shard is None:
        dp_shard, rest = divmod(total, dp_replicate * tp * pp)
        if rest or dp_shard < 1:
            errors.add(
                "resources.layout",
                f"{total} GPUs cannot be split as dp_replicate {dp_replicate} × tp {tp} × pp {pp}.",
            )
            return None
    sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
    small = [name for name, size in sizes.items() if size < 1]
    if small or per_node < 1 or nodes < 1:
        for name in small:
            errors.add(f"resources.layout.{name}", "Must be at least 1.")
        return None
    product = dp_replicate * dp_shard * tp * pp
    if product != total:
        errors.add(
            "resources.layout",
            f"dp_replicate × dp_shard × tp × pp = {dp_replicate} × {dp_shard} × {tp} × {pp} = "
            f"{product}, not the job's {total} GPUs.",
        )
    if per_node % tp:
        errors.add(
            "resources.layout.tp",
            f"tp {tp} must divide gpus_per_node {per_node}: tensor parallelism never crosses "
            "nodes.",
        )
    resources = Resources(
        gpu_type=gpu_type,
        nodes=nodes,
        gpus_per_node=per_node,
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        tp=tp,
        pp=pp,
        min_nodes=wanted.get("min_nodes", nodes),
    )
    if resources.min_nodes > nodes:
        errors.add(
            "resources.min_nodes",
            f"min_nodes {resources.min_nodes} is more than the job's {nodes} nodes: give "
            "1 ≤ min_nodes ≤ nodes.",
        )
        return None
    _check_layout_on_fewer_nodes(resources, errors)
    return resources


def _check_layout_on_fewer_nodes(resources: Resources, errors: SpecErrors) -> None:
    """The layout must hold on every node count of the range, dp_shard taking up the change."""
    fixed = resources.dp_replicate * resources.tp * resources.pp
    for nodes in resources.fewer_node_counts:
        if not resources.dp_shard_on(nodes):
            errors.add(
                "resources.min_nodes",
                f"On {nodes} node(s) the job has {nodes * resources.gpus_per_node} GPUs, which "
                f"dp_replicate {resources.dp_replicate} × tp {resources.tp} × pp "
                f"{resources.pp} = {fixed} does not divide: only dp_shard follows the node "
                "count, so every count from min_nodes to nodes must leave it a whole number.",
            )
            return


def _check_precision(trainer: dict, resources: Resources, errors: SpecErrors) -> None:
    if trainer.get("precision") != "fp8":
        return
    if resources.gpu_type not in FP8_GPU_TYPES:
        fp8_types = " or ".join(FP8_GPU_TYPES)
        lacking = (
            "Any may land on a GPU without them"
            if resources.gpu_type == ANY_GPU
            else f"an {resources.gpu_type} has none"
        )
        errors.add(
            "resources.gpu_type",
            f"precision fp8 needs FP8 tensor cores: set gpu_type to {fp8_types} ({lacking}).",
        )
    if not tp_allowed(resources.tp, precision="fp8"):
        errors.add(
            "resources.layout.tp",
            "precision fp8 runs without tensor parallelism for now: set layout.tp to 1, not "
            f"{resources.tp} (or train in bf16).",
        )


def check_trainer(trainer: dict, resources: Resources, errors: SpecErrors) -> None:
    _check_precision(trainer, resources, errors)
    if trainer.get("preset") and trainer.get("model"):
        errors.add("trainer.model", "Give a preset or explicit sizes, not both.")
        return
    shape = model_shape(trainer)
    if shape is None:
        errors.add("trainer.preset", "Give a preset or explicit model sizes.")
        return
    for problem in shape.problems():
        errors.add("trainer.model", problem)
    if shape.heads % resources.tp or shape.kv_heads % resources.tp:
        errors.add(
            "resources.layout.tp",
            f"tp {resources.tp} must divide the model's {shape.heads} heads and "
            f"{shape.kv_heads} KV heads.",
        )
    if shape.layers % resources.pp:
        errors.add(
            "resources.layout.pp",
            f"pp {resources.pp} must divide the model's {shape.layers} layers.",
        )
    data_parallel = resources.dp_replicate * resources.dp_shard
    batch = trainer.get("global_batch")
    if batch is not None and batch % data_parallel:
        errors.add(
            "trainer.global_batch",
            f"{batch} sequences do not split evenly over {data_parallel} data-parallel ranks.",
        )
    elif batch is not None:
        _check_batch_on_fewer_nodes(trainer, resources, errors)
    seq_len = trainer.get("seq_len")
    if seq_len is not None and seq_len > shape.max_seq_len:
        errors.add("trainer.seq_len", f"The model takes at most {shape.max_seq_len} tokens.")
    if trainer.get("precision") == "fp8":
        for name, size in float8_misfits(shape, seq_len or 0).items():
            # run.json's data.seq_len is the spec's trainer.seq_len; the rest are the model's.
            field, name = (
                ("trainer.seq_len", "seq_len")
                if name == "data.seq_len"
                else ("trainer.model", name)
            )
            errors.add(
                field, f"precision fp8 needs multiples of {FLOAT8_MULTIPLE}: {name} {size} is not."
            )
    _check_init(trainer.get("init") or {}, errors)
    if (trainer.get("eval") or {}).get("every") and trainer.get("dataset") == "synthetic":
        errors.add(
            "trainer.eval.every",
            "Synthetic tokens have no held-out split to evaluate on: train on a data.mixture "
            "of datasets prepared with a validation split, or set eval.every to 0.",
        )


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")


def plain_s3_uri(uri: str) -> str | None:
    """`s3://bucket/prefix/` as written once and for all (a bucket's name, a prefix without
    `.` or `..`, one slash after each part), or None when `uri` is no such thing."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    parts = [p for p in prefix.split("/") if p]
    if not uri.startswith("s3://") or not _BUCKET.fullmatch(bucket):
        return None
    if any(p in (".", "..") for p in parts):
        return None
    return f"s3://{bucket}/" + "".join(f"{p}/" for p in parts)


def _check_init(init: dict, errors: SpecErrors) -> None:
    """init.hf: a directory every node reads, or an S3 prefix each node's agent stages into
    its cache before the run (the trainer reads it at start, on each rank, and checks its
    shapes against the model's sizes then, which it reads from the preset or sizes this spec
    must give)."""
    path = init.get("hf")
    if path is None:
        return
    if path.startswith("s3://"):
        if plain_s3_uri(path) is None:
            errors.add(
                "trainer.init.hf", "An S3 bucket name, then a plain prefix: s3://bucket/prefix/."
            )
    elif not posixpath.isabs(path) or ".." in path.split("/"):
        errors.add(
            "trainer.init.hf",
            "An absolute path (without ..) on storage every node mounts, or s3://bucket/prefix/.",
        )


def _check_batch_on_fewer_nodes(trainer: dict, resources: Resources, errors: SpecErrors) -> None:
    """The global batch stays the same on fewer nodes: it must split over their data-parallel
    ranks, and each rank's larger share into micro-batches, as the trainer checks at start."""
    batch, micro = trainer["global_batch"], trainer.get("micro_batch")
    for nodes in resources.fewer_node_counts:
        ranks = resources.dp_replicate * resources.dp_shard_on(nodes)
        if not ranks:
            return  # the layout itself does not hold there: resources.min_nodes says so
        on = f"on {nodes} node(s) (resources.min_nodes {resources.min_nodes})"
        if batch % ranks:
            errors.add(
                "trainer.global_batch",
                f"{batch} sequences do not split evenly over the {ranks} data-parallel ranks "
                f"the job has {on}.",
            )
            return
        if micro and (batch // ranks) % micro:
            errors.add(
                "trainer.micro_batch",
                f"micro_batch {micro} does not divide the {batch // ranks} sequences each "
                f"data-parallel rank takes {on}.",
            )
            return


def reserved_env_reason(name: str) -> str | None:
    """Why a job's `env` may not set `name` (compared as upper case), or None."""
    upper = name.upper()
    if upper.startswith(NCCL_ENV_PREFIXES):
        return "An NCCL or EFA setting: give it in nccl.overrides, which are linted."
    if upper.startswith(LOADER_ENV_PREFIXES):
        return "The dynamic loader's: a job does not change how its programs are loaded."
    if upper in PYTHON_ENV:
        return "Python's start-up: a job does not change where Python loads code from."
    if upper.startswith(RUN_ENV_PREFIXES) or upper in RUN_ENV:
        return "Set for each run by the control plane or torchrun."
    return None


def check_env(spec: dict, errors: SpecErrors) -> None:
    """The variables a run gets from its spec: `env`, and `secrets` (injected by name)."""
    for field in ("env", "secrets"):
        for name in sorted(spec.get(field) or ()):
            reason = reserved_env_reason(name)
            if reason is not None:
                errors.add(f"{field}.{name}", reason)


def check_command(command: dict, errors: SpecErrors) -> None:
    sources = [key for key in ("git", "path") if command.get(key)]
    if len(sources) != 1:
        errors.add("command", "Give the code's source: git (repo and ref) or path, one of them.")


def check_capacity(
    resources: Resources,
    *,
    where: str,
    pools: list[PoolCapacity],
    quota_limit: int | None,
    errors: SpecErrors,
) -> None:
    """Refuse now what could never run, rather than let it wait forever."""
    if not pools_holding(
        pools,
        gpu_type=resources.gpu_type,
        where=where,
        nodes=resources.nodes,
        gpus_per_node=resources.gpus_per_node,
    ):
        kind = {"owned": "owned", "cloud": "cloud", "owned_then_cloud": "owned or cloud"}[where]
        gpu = "" if resources.gpu_type == ANY_GPU else f"{resources.gpu_type} "
        errors.add(
            "resources",
            f"No {kind} {gpu}pool can ever hold {resources.nodes} × {resources.gpus_per_node} "
            "GPUs in one pool.",
        )
    if quota_limit is not None and resources.gpus > quota_limit:
        errors.add(
            "resources.gpus",
            f"The team's {resources.gpu_type} quota (with borrowing) is {quota_limit} GPUs; "
            f"this job needs {resources.gpus}.",
        )


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @property
    def label(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"replicate {self.dp_replicate}")
        parts.append(f"FSDP {self.dp_shard}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        return " × ".join(parts)

    @property
    def value(self) -> str:
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}x{self.pp}"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def counts_within_limits(*, nodes: int, gpus_per_node: int) -> bool:
    return (
        1 <= nodes <= MAX_NODES
        and 1 <= gpus_per_node <= MAX_GPUS_PER_NODE
        and nodes * gpus_per_node <= MAX_GPUS
    )


def valid_layouts(shape: ModelShape, *, nodes: int, gpus_per_node: int) -> list[Layout]:
    """Every dp_replicate × dp_shard × tp × pp the submit rules accept, simplest first.

    dp_replicate is the node count or 1 (HSDP replicates across nodes, shards within).
    ValueError past a job's limits (COUNTS_LIMIT).
    """
    if not counts_within_limits(nodes=nodes, gpus_per_node=gpus_per_node):
        raise ValueError(COUNTS_LIMIT)
    total = nodes * gpus_per_node
    out = []
    for tp in _divisors(gpus_per_node):
        if shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp in _divisors(total // tp):
            if shape.layers % pp:
                continue
            rest = total // (tp * pp)
            for replicate in sorted({1, nodes}):
                if rest % replicate:
                    continue
                out.append(Layout(replicate, rest // replicate, tp, pp))
    return sorted(set(out), key=lambda layout: (layout.pp, layout.tp, layout.dp_replicate))
