"""Before submit: will a trainer job fit its GPUs, how long will it run, what will it cost.

For each layout the job's GPU counts allow (specs.valid_layouts), the memory model
(workers/trainer/memory.py) gives the peak per GPU, line by line, and a verdict
against the GPU type's memory: fits, tight (within 10%) or does not fit. Then:

- step time: the job's FLOPs per step (6N + 12·L·d·S per token, as the trainer
  counts them) over its GPUs at the MFU measured for the GPU type and model
  (apps/jobs/mfu.json, fed from bench/RESULTS.md), with what recomputation adds
  (full checkpointing runs the forward pass twice) and a pipeline's bubble;
- run time: the requested steps at that step time, plus the start-up allowance;
- cost: run time × GPUs × the cheapest eligible pool's price per GPU-hour now;
- the suggested layout: the cheapest that fits and ends within the time limit.

Each answer says what it rests on (Advice.basis), since the MFU table holds only
what was measured: a model or GPU not in it borrows the nearest row and says so.
"""

import json
import math
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cache
from pathlib import Path

import workers.trainer.memory as memory
from apps.costs.selectors import projection_for
from apps.jobs import specs
from apps.jobs.runconfig import trainer_settings
from workers.trainer.config import ConfigError, RunConfig, microbatches, parse
from workers.trainer.presets import PRESETS, ModelShape, flops_per_token

MFU_TABLE = Path(__file__).with_name("mfu.json")
# What recomputation costs in matrix work, against 6N per token: full checkpointing runs
# each block's forward again (8N); selective recomputes only norms and elementwise work.
RECOMPUTE = {"none": 1.0, "selective": 1.05, "full": 4 / 3}
START_UP_S = {False: 60, True: 150}  # model build and NCCL start; compiling adds ~1.5 min


@dataclass(frozen=True)
class Throughput:
    mfu: float
    basis: str


@dataclass(frozen=True)
class LayoutAdvice:
    layout: specs.Layout
    gpu_type: str
    gpu_memory_gib: float
    estimate: memory.Estimate
    step_time_s: float | None
    run_time_s: float | None
    cost: Decimal | None

    @property
    def fit(self) -> str:
        return self.estimate.fit(self.gpu_memory_gib)

    @property
    def needs_gib(self) -> float:
        return round(self.estimate.total / memory.GIB, 1)

    def within(self, time_limit_s: int) -> bool:
        return self.run_time_s is not None and self.run_time_s <= time_limit_s

    def refusal(self) -> str:
        return (
            f"needs {self.needs_gib:g} GiB per GPU; an {self.gpu_type} has "
            f"{self.gpu_memory_gib:.0f}"
        )


@dataclass(frozen=True)
class Advice:
    gpu_type: str
    nodes: int
    gpus_per_node: int
    time_limit_s: int
    layouts: list[LayoutAdvice]
    chosen: LayoutAdvice | None  # the layout the spec asks for, when it gives one
    suggested: LayoutAdvice | None
    basis: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@cache
def _mfu_table() -> dict:
    return json.loads(MFU_TABLE.read_text())


def measured_throughput(gpu_type: str, shape: ModelShape, *, compiled: bool, ac: str) -> Throughput:
    """MFU for this GPU type and model from the nearest measured row, corrected for
    recomputation; the basis says which row and what was borrowed."""
    rows = _mfu_table()["rows"]
    same_gpu = [r for r in rows if r["gpu_type"] == gpu_type]
    pool = same_gpu or [r for r in rows if r["gpu_type"] in ("H100", "H200")]
    same_mode = [r for r in pool if r["compile"] == compiled] or pool
    size = math.log(shape.parameters())
    row = min(same_mode, key=lambda r: abs(math.log(PRESETS[r["preset"]].parameters()) - size))
    # The table's MFU counts 6N per token; the hardware did that times the row's recompute.
    mfu = row["mfu"] * RECOMPUTE[row["activation_checkpointing"]] / RECOMPUTE[ac]
    if gpu_type == "A100" and row["gpu_type"] != "A100":
        mfu *= 0.9  # unmeasured: Ampere reaches a little less of its (lower) peak
    borrowed = []
    if row["gpu_type"] != gpu_type:
        borrowed.append(f"measured on {row['gpu_type']}, not {gpu_type}")
    if row["compile"] != compiled:
        borrowed.append(
            "a compiled run's figure for an eager job"
            if row["compile"]
            else "an eager run's figure for a compiled job"
        )
    words = f"MFU {mfu:.2f} from {row['preset']} on {row['gpu_type']}"
    words += f" ({'compiled' if row['compile'] else 'eager'}, checkpointing "
    words += f"{row['activation_checkpointing']}, measured {row['measured']})"
    if borrowed:
        words += "; borrowed: " + ", ".join(borrowed)
    return Throughput(mfu=mfu, basis=words)


def _pipeline_bubble(config: RunConfig) -> float:
    """Time with a pipeline's idle warm-up and drain, over time without."""
    pp = config.layout.pp
    if pp == 1:
        return 1.0
    count = microbatches(config)
    per_rank = config.pipeline.stages_per_rank if config.pipeline.schedule != "1f1b" else 1
    return (count + (pp - 1) / per_rank) / count


def _peak_flops(gpu_type: str) -> float | None:
    tflops = _mfu_table()["peak_bf16_tflops"].get(gpu_type)
    return tflops * 1e12 if tflops else None


def advise(
    trainer: dict,
    *,
    gpu_type: str,
    nodes: int,
    gpus_per_node: int,
    time_limit_s: int,
    pool_ids: list[int],
    spot: bool = False,
    layout: specs.Layout | None = None,
) -> Advice:
    """Every layout of these counts for this trainer section, and the one to take.

    `gpu_type` is a concrete type (the caller resolves "any" to the pools' types);
    `pool_ids` the pools that could hold the job, for its price; `layout` the one the
    spec asks for, if any. ConfigError when the trainer section itself cannot run.
    """
    shape = specs.model_shape(trainer)
    if shape is None:
        raise ConfigError("Give a preset or explicit model sizes.")
    gpu_memory = memory.gpu_memory_gib(gpu_type) or 80.0
    gpus = nodes * gpus_per_node
    throughput = measured_throughput(
        gpu_type,
        shape,
        compiled=bool(trainer.get("compile")),
        ac=trainer.get("activation_checkpointing", "selective"),
    )
    peak = _peak_flops(gpu_type)
    price = projection_for(pool_ids=pool_ids, gpus=gpus, time_limit_s=3600, spot_allowed=spot)
    basis = [throughput.basis]
    if price is not None:
        basis.append(f"{price.per_gpu_hour:.3f} per GPU-hour in {price.cheapest_pool}")
    else:
        basis.append("no price is set for the pools that could hold it")
    tokens = trainer["global_batch"] * trainer["seq_len"]
    work = flops_per_token(shape, trainer["seq_len"]) * tokens
    if trainer.get("precision") == "fp8":
        basis.append("fp8 timed at the measured bf16 rate: an upper bound (float8 is faster)")
    advice = []
    for candidate in specs.valid_layouts(shape, nodes=nodes, gpus_per_node=gpus_per_node):
        try:
            config = parse(trainer_settings(trainer, _layout_dict(candidate)))
        except ConfigError:
            # The batch does not split over this layout's data-parallel ranks, or fp8 meets
            # tensor parallelism: never a layout to offer.
            continue
        estimate = memory.estimate(config)
        step = run = cost = None
        if peak:
            bubble = _pipeline_bubble(config)
            step = work / (gpus * peak * throughput.mfu) * bubble
            run = trainer["steps"] * step + START_UP_S[bool(trainer.get("compile"))]
            if price is not None:
                cost = price.per_gpu_hour * Decimal(gpus) * Decimal(run) / 3600
        advice.append(LayoutAdvice(candidate, gpu_type, gpu_memory, estimate, step, run, cost))
    chosen = next((a for a in advice if a.layout == layout), None) if layout else None
    return Advice(
        gpu_type=gpu_type,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        time_limit_s=time_limit_s,
        layouts=advice,
        chosen=chosen,
        suggested=suggest(advice, time_limit_s),
        basis=basis,
    )


def suggest(advice: list[LayoutAdvice], time_limit_s: int) -> LayoutAdvice | None:
    """The cheapest layout that fits (room to spare before tight) and ends in time; failing
    that, the fastest that fits at all."""
    fitting = [a for a in advice if a.fit != "no"]
    if not fitting:
        return None

    def key(a: LayoutAdvice):
        return (
            not a.within(time_limit_s),
            a.fit == "tight",
            a.run_time_s if a.run_time_s is not None else math.inf,
            a.layout.pp,
            a.layout.tp,
        )

    return min(fitting, key=key)


def _layout_dict(layout: specs.Layout) -> dict[str, int]:
    return {
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "tp": layout.tp,
        "pp": layout.pp,
    }


# --- a whole spec: what submit checks and the estimate endpoint answers ----------------------


def gpu_types_for(gpu_type: str, pools: list, pool_ids: list[int]) -> list[str]:
    """The GPU types the job may land on: its own, or, for any type, those of the pools
    that could hold it (H100 when none can: the answer then says so elsewhere)."""
    if gpu_type != specs.ANY_GPU:
        return [gpu_type]
    return sorted({p.gpu_type for p in pools if p.pool_id in pool_ids}) or ["H100"]


def advise_spec(
    spec: dict, *, resources: specs.Resources, pools: list, pool_ids: list[int]
) -> list[Advice]:
    """The advice for each GPU type a checked trainer spec may land on."""
    trainer = spec["trainer"]
    layout = specs.Layout(resources.dp_replicate, resources.dp_shard, resources.tp, resources.pp)
    spot = spec.get("placement", {}).get("spot", False)
    return [
        advise(
            trainer,
            gpu_type=gpu_type,
            nodes=resources.nodes,
            gpus_per_node=resources.gpus_per_node,
            time_limit_s=spec["time_limit_s"],
            pool_ids=[p.pool_id for p in pools if p.pool_id in pool_ids and p.gpu_type == gpu_type],
            spot=spot,
            layout=layout,
        )
        for gpu_type in gpu_types_for(resources.gpu_type, pools, pool_ids)
    ]


def check_fit(advice: list[Advice], errors: specs.SpecErrors) -> None:
    """Refuse a layout that fits none of the GPU types the job may land on, with the numbers
    and what would fit instead."""
    chosen = [a.chosen for a in advice if a.chosen is not None]
    if not chosen or any(c.fit != "no" for c in chosen):
        return
    worst = min(chosen, key=lambda c: c.gpu_memory_gib - c.needs_gib)
    message = f"The memory model says the job does not fit: it {worst.refusal()}."
    suggested = next((a.suggested for a in advice if a.suggested is not None), None)
    if suggested is not None:
        message += f" {suggested.layout.label} fits ({suggested.needs_gib:g} GiB per GPU)."
    else:
        message += (
            f" No layout of {advice[0].gpus} GPUs fits: ask for more GPUs, a smaller batch or "
            "micro_batch, or activation checkpointing."
        )
    message += " Set trainer.check_memory to false to submit it anyway."
    errors.add("resources.layout", message)


def stored(advice: list[Advice]) -> dict | None:
    """What the job keeps of its advice (Job.estimate), for the truth beside it afterwards."""
    chosen = [a for a in advice if a.chosen is not None]
    if not chosen:
        return None
    first = chosen[0].chosen
    return {
        "layout": first.layout.label,
        "memory": first.estimate.as_dict(),
        "by_gpu_type": {
            a.gpu_type: {
                "fit": a.chosen.fit,
                "gpu_memory_gib": a.chosen.gpu_memory_gib,
                "step_time_s": a.chosen.step_time_s,
                "run_time_s": a.chosen.run_time_s,
                "cost": str(round(a.chosen.cost, 2)) if a.chosen.cost is not None else None,
            }
            for a in chosen
        },
        "basis": chosen[0].basis,
    }
