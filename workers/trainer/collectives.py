"""A collective benchmark in the manner of nccl-tests, torch only: what a pool's fabric carries.

    torchrun --nproc-per-node=8 -m workers.trainer.collectives \\
        --sizes 1K:1G --ops all_reduce,all_gather,reduce_scatter,all_to_all --warmup 5 --iters 20

Without torchrun it is a world of one. It runs NCCL on GPUs (NVLink multicast off unless
the environment says otherwise: NCCL_NVLS_ENABLE=0 and its siblings, as the shared GPU hosts
require) and gloo on CPUs. For each operation and message size, every rank runs --warmup
untimed iterations, meets the others at a barrier, then times --iters iterations one by one
(CUDA events around each on a GPU, so the figure is the device's, not the launch's).
A rank's time is the median of its iterations; the reported `time_us` is the largest of
those medians over the ranks (the slowest rank sets the pace, as nccl-tests reports it),
and `time_us_max` the slowest single iteration on any rank.

Bandwidth follows nccl-tests' definitions (doc/PERFORMANCE.md in NVIDIA/nccl-tests, and
src/alltoall.cu for all-to-all): algbw = S / t in GB/s (10^9 bytes), where S, the `bytes`
reported, is the size of the whole array an operation handles on one rank —

- all-reduce: the buffer reduced (input = output);
- all-gather: the gathered output, that is n × each rank's input ("sendcount · n");
- reduce-scatter: the input reduced, that is n × each rank's output ("recvcount · n");
- all-to-all: each rank's send buffer, n chunks of S / n;

and busbw = algbw × the factor in `bus_factor` (all-reduce 2(n−1)/n; all-gather,
reduce-scatter and all-to-all (n−1)/n), which makes figures comparable across world sizes
and with the links' peak. A requested size is rounded down to whole elements, and for the
chunked operations to a multiple of n elements, as nccl-tests does; `bytes` is what ran.

Each result is checked exactly against what the ranks' inputs imply; the wrong elements
are counted in `errors` (summed over the ranks). Rank s fills its input with v(s) = (s mod
m) + 1, and the chunk it addresses to rank j (reduce-scatter, all-to-all) with v(s) + c(j),
c(j) = j mod m, with m chosen so that every partial sum is an integer the dtype holds
exactly: then all-reduce must give Σ v everywhere, all-gather chunk j must hold v(j),
reduce-scatter on rank r must hold Σ v + n·c(r) (every rank counted once, and the right
chunk), and all-to-all's chunk s on rank r must hold v(s) + c(r) (from s, meant for r).

In a world of one the collectives are trivial (bus bandwidth 0), so it also times a local
copy of each size (device to device on a GPU, memcpy on a CPU): op "copy", busbw = algbw
(the memory moves twice the bytes: one read, one write). Ask for "copy" in --ops to get it
in bigger worlds too.

Rank 0 prints one JSON event per line, as the trainer does (metrics.emit), so the agent
relays them unchanged; every rank first prints its "env" event:

    {"event": "collective_start", "world_size", "backend", "device", "dtype", "sizes",
     "ops", "warmup", "iters", "torch", "nccl", "time"}
    {"event": "collective", "op", "bytes", "dtype", "world_size", "time_us",
     "time_us_max", "algbw_gbps", "busbw_gbps", "errors", "iters"}
    {"event": "collective_end", "measurements", "errors", "elapsed_s", "time"}

`--label candidate=3,round=1` adds those fields to each of rank 0's three kinds of event
(a value that reads as an integer is one), so that runs launched one after another, as
workers.trainer.tuning launches them, can be told apart in one stream.

It exits 1 when any result was wrong, 2 on bad arguments.
"""

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
OPS = (*COLLECTIVES, "copy")
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
DTYPES = ("float32", "bfloat16", "float16")

# The fields of rank 0's events: a label may not take one's name (it would replace it).
EVENT_FIELDS = frozenset(
    {
        *("event", "world_size", "backend", "device", "dtype", "sizes", "ops", "warmup"),
        *("iters", "torch", "nccl", "time", "op", "bytes", "time_us", "time_us_max"),
        *("algbw_gbps", "busbw_gbps", "errors", "measurements", "elapsed_s"),
    }
)

# NVLink multicast off in NCCL, PyTorch and NVSHMEM (as bench/trainer.py sets it): the shared
# GPU hosts require it. A value the job's environment gives wins.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` over `world_size` ranks (nccl-tests' PERFORMANCE.md)."""
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "copy": 1.0,  # point to point, like nccl-tests' sendrecv
    }
    return factors[op]


def parse_size(text: str) -> int:
    """ "64K" → 65536 (binary units: K, M, G; a plain number is bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match or int(match[1]) == 0:
        raise ValueError(f"{text!r} is not a size (e.g. 4096, 64K, 16M, 1G)")
    return int(match[1]) * SIZE_UNITS[match[2].upper()]


def parse_sizes(text: str) -> list[int]:
    """ "MIN:MAX" → MIN, 2·MIN, … up to MAX; "A,B,C" → those sizes, in the order given."""
    if ":" in text:
        low, _, high = text.partition(":")
        low, high = parse_size(low), parse_size(high)
        if low > high:
            raise ValueError(f"{text!r}: the smallest size is above the largest")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 2
        return sizes
    return [parse_size(part) for part in text.split(",") if part.strip()]


def parse_ops(text: str) -> list[str]:
    """ "all" → the four collectives; otherwise a comma-separated list of OPS."""
    if text.strip() == "all":
        return list(COLLECTIVES)
    ops = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"unknown operation {', '.join(unknown)}: choose from {', '.join(OPS)}")
    return ops


def parse_labels(text: str) -> dict[str, int | str]:
    """ "candidate=3,round=1,fabric=ib" → {"candidate": 3, "round": 1, "fabric": "ib"}."""
    labels: dict[str, int | str] = {}
    for part in text.split(","):
        key, equals, value = part.strip().partition("=")
        if not equals or not re.fullmatch(r"[a-z_]+", key):
            raise ValueError(f"{part.strip()!r} is not a label (KEY=VALUE, the key in a-z and _)")
        if key in EVENT_FIELDS:
            raise ValueError(f"label {key!r} would replace an event's own field")
        labels[key] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return labels


def bandwidths(op: str, *, size: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for `size` bytes (as `bytes` counts them) moved in `seconds`."""
    algbw = size / seconds / 1e9
    return algbw, algbw * bus_factor(op, world_size)


def elements_for(op: str, size: int, *, element_size: int, world_size: int) -> int:
    """The elements of the array an operation handles for a requested size in bytes."""
    count = size // element_size
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count -= count % world_size
    return max(count, world_size if op != "copy" else 1)


# --- measuring (imports torch) -----------------------------------------------------------------


@dataclass
class World:
    rank: int
    size: int
    device: object  # torch.device
    backend: str

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def start_world() -> World:
    """Join the process group as the trainer does (a world of one without torchrun)."""
    import torch.distributed as dist

    from workers.trainer import parallelize

    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    parallelize.use_current_flight_recorder_names()
    _, _, local_rank = parallelize.world_of_one_unless_torchrun()
    device, backend = parallelize.join_process_group(local_rank, timeout_s=600)
    return World(dist.get_rank(), dist.get_world_size(), device, backend)


def exact_modulus(dtype, world_size: int) -> int:
    """The m of v(s) = (s mod m) + 1 that keeps every partial sum of v(s) + c(j) exact."""
    import math

    import torch

    # Integers up to 2^digits are exact (digits: the significand's bits, 24 for float32).
    exact_up_to = 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)
    return max(1, min(world_size, exact_up_to // (2 * world_size)))


class Case:
    """One operation at one size: its buffers, one iteration, and the check of its result."""

    def __init__(self, op: str, size: int, *, world: World, dtype):
        import torch

        self.op, self.world, self.dtype = op, world, dtype
        n, rank = world.size, world.rank
        element_size = torch.empty((), dtype=dtype).element_size()
        count = elements_for(op, size, element_size=element_size, world_size=n)
        self.bytes = count * element_size
        m = exact_modulus(dtype, n)
        self.v = [(s % m) + 1 for s in range(n)]
        self.c = [j % m for j in range(n)]
        new = lambda elements: torch.empty(elements, dtype=dtype, device=world.device)  # noqa: E731
        if op == "all_reduce":
            self.buffer = new(count)
        elif op == "all_gather":
            self.input, self.output = new(count // n), new(count)
            self.input.fill_(self.v[rank])
        elif op == "reduce_scatter":
            self.input, self.output = new(count), new(count // n)
            self.fill_chunks(self.input)
        elif op == "all_to_all":
            self.input, self.output = new(count), new(count)
            self.fill_chunks(self.input)
        else:  # copy
            self.input, self.output = new(count), new(count)
            self.input.fill_(self.v[rank])

    def fill_chunks(self, tensor) -> None:
        import torch

        n, rank = self.world.size, self.world.rank
        rows = torch.tensor([self.v[rank] + self.c[j] for j in range(n)], dtype=self.dtype)
        tensor.view(n, -1).copy_(rows.to(self.world.device)[:, None].expand(n, -1))

    def prepare(self) -> None:
        """Untimed, before each iteration: all-reduce works in place, so it starts afresh."""
        if self.op == "all_reduce":
            self.buffer.fill_(self.v[self.world.rank])

    def run(self) -> None:
        import torch.distributed as dist

        if self.op == "all_reduce":
            dist.all_reduce(self.buffer)
        elif self.op == "all_gather":
            _newest(dist, "all_gather_single", "all_gather_into_tensor")(self.output, self.input)
        elif self.op == "reduce_scatter":
            _newest(dist, "reduce_scatter_single", "reduce_scatter_tensor")(self.output, self.input)
        elif self.op == "all_to_all":
            dist.all_to_all_single(self.output, self.input)
        else:
            self.output.copy_(self.input)

    def errors(self) -> int:
        """The elements of the last result that differ from what the inputs imply."""
        import torch

        n, rank = self.world.size, self.world.rank
        if self.op == "all_reduce":
            return int((self.buffer != sum(self.v)).sum())
        if self.op == "reduce_scatter":
            return int((self.output != sum(self.v) + n * self.c[rank]).sum())
        if self.op == "copy":
            return int((self.output != self.v[rank]).sum())
        if self.op == "all_gather":
            expected = self.v
        else:  # all_to_all: chunk s came from rank s and was meant for this rank
            expected = [self.v[s] + self.c[rank] for s in range(n)]
        rows = torch.tensor(expected, dtype=self.dtype, device=self.world.device)[:, None]
        return int((self.output.view(n, -1) != rows).sum())


def _newest(module, name: str, old_name: str):
    # Newer torches renamed the tensor forms and warn under the old names on every call.
    return getattr(module, name, None) or getattr(module, old_name)


def time_iterations(run: Callable[[], None], prepare: Callable[[], None], *, world, iters):
    """Seconds per iteration, each timed on its own (CUDA events on a GPU)."""
    import torch

    if world.on_gpu:
        marks = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for start, end in marks:
            prepare()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize(world.device)
        return [start.elapsed_time(end) / 1e3 for start, end in marks]
    seconds = []
    for _ in range(iters):
        prepare()
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return seconds


def measure(op: str, size: int, *, world: World, dtype, warmup: int, iters: int) -> dict:
    """One operation at one size, as every rank saw it: the event rank 0 prints."""
    import torch
    import torch.distributed as dist

    case = Case(op, size, world=world, dtype=dtype)
    for _ in range(warmup):
        case.prepare()
        case.run()
    if world.on_gpu:
        torch.cuda.synchronize(world.device)
    dist.barrier()
    seconds = time_iterations(case.run, case.prepare, world=world, iters=iters)
    errors = case.errors()
    # The slowest rank's median and worst iteration; the wrong elements of every rank.
    times = torch.tensor([statistics.median(seconds), max(seconds)], dtype=torch.float64)
    counts = torch.tensor([errors], dtype=torch.int64)
    times, counts = times.to(world.device), counts.to(world.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    median, worst = times.tolist()
    algbw, busbw = bandwidths(op, size=case.bytes, seconds=median, world_size=world.size)
    return {
        "event": "collective",
        "op": op,
        "bytes": case.bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "world_size": world.size,
        "time_us": round(median * 1e6, 3),
        "time_us_max": round(worst * 1e6, 3),
        "algbw_gbps": round(algbw, 6),
        "busbw_gbps": round(busbw, 6),
        "errors": int(counts.item()),
        "iters": iters,
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m workers.trainer.collectives",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--sizes", default="1K:1G", help="MIN:MAX (doubling) or a list; K, M, G suffixes"
    )
    parser.add_argument("--ops", default="all", help=f"all, or a list from {', '.join(OPS)}")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument(
        "--label", default="", help="KEY=VALUE[,KEY=VALUE]: fields added to rank 0's events"
    )
    args = parser.parse_args(argv)
    try:
        args.sizes = parse_sizes(args.sizes)
        args.ops = parse_ops(args.ops)
        args.label = parse_labels(args.label) if args.label else {}
    except ValueError as error:
        parser.error(str(error))
    if args.warmup < 0 or args.iters < 1:
        parser.error("--warmup must be 0 or more and --iters 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_with = dict(os.environ)

    import torch
    import torch.distributed as dist

    from workers.trainer import metrics

    metrics.emit(metrics.environment_event(started_with))
    began = time.perf_counter()
    world = start_world()
    dtype = getattr(torch, args.dtype)
    ops = list(args.ops)
    if world.size == 1 and "copy" not in ops:
        ops.append("copy")  # the collectives are trivial here; a copy exercises the device
    labels = args.label

    def report(event: dict) -> None:
        if world.rank == 0:
            metrics.emit({**event, **labels})

    report(
        {
            "event": "collective_start",
            "world_size": world.size,
            "backend": world.backend,
            "device": torch.cuda.get_device_name(world.device) if world.on_gpu else "cpu",
            "dtype": args.dtype,
            "sizes": args.sizes,
            "ops": ops,
            "warmup": args.warmup,
            "iters": args.iters,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if world.on_gpu else None,
            "time": time.time(),
        }
    )
    errors = measurements = 0
    try:
        for op in ops:
            for size in args.sizes:
                event = measure(
                    op, size, world=world, dtype=dtype, warmup=args.warmup, iters=args.iters
                )
                report(event)
                errors += event["errors"]
                measurements += 1
        report(
            {
                "event": "collective_end",
                "measurements": measurements,
                "errors": errors,
                "elapsed_s": round(time.perf_counter() - began, 3),
                "time": time.time(),
            }
        )
    finally:
        dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
