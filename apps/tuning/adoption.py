"""The adoption rule of tuning runs: a candidate replaces the baseline only where it is faster
by more than the noise, and is slower beyond the noise nowhere.

Pure arithmetic, no Django and no torch. A tuning run measures the baseline and each
candidate in interleaved rounds (at least MIN_ROUNDS), giving for each a bus bandwidth per
message size per round: `{size_bytes: [busbw of round 1, round 2, …]}`.

The statistic is the paired per-round log ratio, log(candidate / baseline) of the same round
and size, and the interval is a percentile bootstrap (seeded, so deterministic) of the median
of those ratios. Why paired: the rounds are interleaved so that drift (a neighbour's job on
the fabric, clocks warming up) hits the baseline and the candidate of one round alike; the
ratio within a round cancels it, where a difference of the two medians would count it as noise
twice and need many more rounds to see the same gain. Why logs: bandwidths multiply (a
setting makes a transfer x% faster), so a ratio is the natural change and the same 5% counts
alike at 4 KiB and at 1 GiB. Why the median: one round hit by a stray job should not decide;
with few rounds the bootstrap of a median is also conservative rather than too narrow (with 5
rounds, a 95% interval excludes zero only when all 5 rounds agree, which chance does 1 time in
32 for each direction).

A candidate is adopted when, at every size that matters (by default the bundled trainer's
gradient bucket sizes, `gradient_bucket_sizes`), the interval of its change lies above zero,
and at no measured size it lies below zero. Adopting nothing is a valid and common result.
"""

import dataclasses
import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from workers.trainer.config import Layout
from workers.trainer.presets import ModelShape

MIN_ROUNDS = 5
RESAMPLES = 2000
# The collective benchmark's default sizes (workers/trainer/collectives.py, --sizes 1K:1G).
SMALLEST, LARGEST = 2**10, 2**30
# DDP's buckets (torch.nn.parallel.DistributedDataParallel's defaults): the first 1 MiB, the
# rest 25 MiB, all-reduced in fp32.
DDP_FIRST_BUCKET, DDP_BUCKET = 2**20, 25 * 2**20


class MeasurementError(ValueError):
    """The figures cannot be judged (too few rounds, unpaired rounds, a size not measured)."""


# --- the sizes that matter -----------------------------------------------------------------


def power_of_two(size: float) -> int:
    """The benchmark's size nearest to `size` bytes (nearest in log scale), within 1 KiB–1 GiB."""
    if size <= 0:
        raise ValueError("a message size must be positive")
    exponent = round(math.log2(size))
    return min(max(2**exponent, SMALLEST), LARGEST)


def gradient_bucket_sizes(shape: ModelShape, layout: Layout) -> tuple[int, ...]:
    """The message sizes the bundled trainer's data parallelism sends, rounded to the benchmark's
    powers of two, smallest first: its default "sizes that matter".

    Under FSDP2 (workers/trainer/parallelize.py apply_fsdp: one group per block and one at
    the root) each block's parameters are all-gathered in bf16 and its gradients
    reduce-scattered in fp32, both as the whole (unsharded) group of this tensor-parallel
    rank, which is what the benchmark's `bytes` counts for those operations. The root group
    holds the embedding and the output head (the first and the last pipeline stage's, when
    pipelined). HSDP (dp_replicate > 1 as well) all-reduces each shard across the replicas.
    DDP (replication alone) all-reduces fp32 buckets of its default sizes. A layout without
    data parallelism sends no gradients: the result is empty.
    """
    tp = layout.tp
    if layout.dp == 1:
        return ()
    if layout.dp_shard == 1 and tp == 1:
        return tuple(sorted({power_of_two(DDP_FIRST_BUCKET), power_of_two(DDP_BUCKET)}))
    norms = 2 * shape.dim  # RMSNorm weights are replicated, not split by tp
    block = (shape.block_parameters() - norms) / tp + norms
    matrix = shape.vocab_size * shape.dim / tp
    # The root group: embedding, output head and final norm; split between the first and
    # the last stage when pipelined.
    roots = [2 * matrix + shape.dim] if layout.pp == 1 else [matrix, matrix + shape.dim]
    sizes = set()
    for params in [block, *roots]:
        sizes.add(power_of_two(params * 2))  # all-gather, bf16
        sizes.add(power_of_two(params * 4))  # reduce-scatter, fp32
        if layout.dp_replicate > 1 and layout.dp_shard > 1:
            sizes.add(power_of_two(params * 4 / layout.dp_shard))  # HSDP's all-reduce
    return tuple(sorted(sizes))


# --- the verdict ---------------------------------------------------------------------------


def size_label(size: int) -> str:
    """4096 → "4 KiB", 67108864 → "64 MiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _percent(value: float) -> str:
    return f"{value:.0f}%" if abs(value) >= 1 or value == 0 else f"{value:.1f}%"


@dataclass(frozen=True)
class SizeChange:
    """The candidate's change in bus bandwidth at one size, in percent (positive: faster)."""

    size: int
    change: float
    low: float
    high: float
    matters: bool
    op: str = ""  # the operation, where several were judged together (judge_ops)

    @property
    def faster(self) -> bool:
        return self.low > 0

    @property
    def slower(self) -> bool:
        return self.high < 0

    def describe(self) -> str:
        said = self._describe()
        return f"{self.op.replace('_', '-')}: {said}" if self.op else said

    def _describe(self) -> str:
        at = size_label(self.size)
        if self.faster:
            return (
                f"faster by {_percent(self.change)} "
                f"[{_percent(self.low)}, {_percent(self.high)}] at {at}"
            )
        if self.slower:
            return (
                f"slower by {_percent(-self.change)} "
                f"[{_percent(-self.high)}, {_percent(-self.low)}] at {at}"
            )
        return (
            f"within the noise at {at} ({self.change:+.1f}% [{self.low:+.1f}%, {self.high:+.1f}%])"
        )


@dataclass(frozen=True)
class Verdict:
    """Whether one candidate replaces the baseline, with the figures that decided it."""

    candidate: str
    adopt: bool
    confidence: float
    rounds: int
    changes: tuple[SizeChange, ...]  # every measured size, smallest first
    reasons: tuple[str, ...]

    @property
    def summary(self) -> str:
        """ "faster by 6% [3%, 9%] at 64 MiB; slower by 4% [1%, 7%] at 4 KiB: not adopted"."""
        return "; ".join(self.reasons) + (": adopted" if self.adopt else ": not adopted")

    @property
    def mattering(self) -> tuple[SizeChange, ...]:
        return tuple(c for c in self.changes if c.matters)

    @property
    def lower_bound(self) -> float:
        """The smallest lower bound of the change at the sizes that matter, in percent."""
        return min(c.low for c in self.mattering)

    def at(self, size: int) -> SizeChange:
        return next(c for c in self.changes if c.size == size)


def _rounds(figures: Mapping[int, Sequence[float]], what: str) -> dict[int, list[float]]:
    out = {}
    for size, values in figures.items():
        values = [float(v) for v in values]
        if len(values) < MIN_ROUNDS:
            raise MeasurementError(
                f"{what} has {len(values)} rounds at {size_label(size)}; at least "
                f"{MIN_ROUNDS} are needed to tell a change from the noise"
            )
        if not all(v > 0 and math.isfinite(v) for v in values):
            raise MeasurementError(f"{what} has a bandwidth that is not positive at {size}")
        out[int(size)] = values
    return out


def _interval(ratios: list[float], *, confidence: float, resamples: int, seed: str):
    """The median of `ratios` and its percentile bootstrap interval (all in log space)."""
    rng = random.Random(seed)  # noqa: S311 (a seeded statistic, not a secret)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = medians[math.floor(tail * (resamples - 1))]
    high = medians[math.ceil((1 - tail) * (resamples - 1))]
    return statistics.median(ratios), low, high


def judge(
    baseline: Mapping[int, Sequence[float]],
    candidate: Mapping[int, Sequence[float]],
    *,
    sizes: Iterable[int] | None = None,
    confidence: float = 0.95,
    name: str = "candidate",
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Verdict:
    """The adoption verdict for one candidate against the baseline.

    `baseline` and `candidate`: {size in bytes: bus bandwidth per round}, round i of one
    measured next to round i of the other. `sizes`: the sizes that matter (None: all the
    measured sizes). The same input always gives the same verdict.
    """
    if not 0.5 <= confidence < 1:
        raise MeasurementError("the confidence must be at least 0.5 and below 1")
    base, cand = _rounds(baseline, "the baseline"), _rounds(candidate, name)
    if set(base) != set(cand):
        missing = sorted(set(base) ^ set(cand))
        raise MeasurementError(
            f"the baseline and {name} were not measured at the same sizes "
            f"({', '.join(size_label(s) for s in missing)})"
        )
    if not base:
        raise MeasurementError("no measurements")
    matter = set(base) if sizes is None else {int(s) for s in sizes}
    if not matter:
        raise MeasurementError("no sizes that matter: give some, or None for all")
    unmeasured = sorted(matter - set(base))
    if unmeasured:
        raise MeasurementError(
            f"sizes that matter were not measured: {', '.join(size_label(s) for s in unmeasured)}"
        )
    changes = []
    for size in sorted(base):
        if len(base[size]) != len(cand[size]):
            raise MeasurementError(
                f"{size_label(size)}: {len(base[size])} baseline rounds against "
                f"{len(cand[size])} of {name}; rounds are compared in pairs"
            )
        ratios = [math.log(c / b) for b, c in zip(base[size], cand[size], strict=True)]
        mid, low, high = _interval(
            ratios, confidence=confidence, resamples=resamples, seed=f"{seed}:{size}"
        )
        pct = [100 * math.expm1(x) for x in (mid, low, high)]
        changes.append(SizeChange(size, pct[0], pct[1], pct[2], matters=size in matter))
    rounds = min(len(v) for v in base.values())
    mattering = [c for c in changes if c.matters]
    slower_elsewhere = [c for c in changes if c.slower and not c.matters]
    adopt = all(c.faster for c in mattering) and not slower_elsewhere
    reasons = [c.describe() for c in mattering] + [c.describe() for c in slower_elsewhere]
    return Verdict(
        candidate=name,
        adopt=adopt,
        confidence=confidence,
        rounds=rounds,
        changes=tuple(changes),
        reasons=tuple(reasons),
    )


@dataclass(frozen=True)
class Choice:
    """The candidate a tuning run adopts, or None: the baseline stays."""

    best: Verdict | None
    verdicts: tuple[Verdict, ...]
    reason: str


def choose(verdicts: Iterable[Verdict]) -> Choice:
    """The adopted candidate with the largest lower bound of improvement at the sizes that
    matter (ties: the first given), or none, saying so."""
    verdicts = tuple(verdicts)
    adopted = [v for v in verdicts if v.adopt]
    if not adopted:
        counted = f"none of the {len(verdicts)} candidates" if verdicts else "no candidate"
        return Choice(
            None,
            verdicts,
            f"{counted} is faster beyond the noise at the sizes that matter without being "
            "slower elsewhere: nothing adopted, the baseline stays",
        )
    best = max(adopted, key=lambda v: v.lower_bound)  # max keeps the first of equals
    others = len(adopted) - 1
    also = f" ({others} other candidate{'s' if others != 1 else ''} also passed)" if others else ""
    return Choice(best, verdicts, f"{best.candidate} adopted: {'; '.join(best.reasons)}{also}")


def judge_all(
    baseline: Mapping[int, Sequence[float]],
    candidates: Mapping[str, Mapping[int, Sequence[float]]],
    *,
    sizes: Iterable[int] | None = None,
    confidence: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Choice:
    """Judge every candidate and choose. Each is judged at a Bonferroni-corrected confidence,
    1 − (1 − confidence) / k for k candidates, so that the chance of adopting any of k
    candidates that are no better stays near 1 − confidence instead of growing with k."""
    sizes = None if sizes is None else tuple(sizes)
    each = 1 - (1 - confidence) / max(len(candidates), 1)
    return choose(
        judge(
            baseline,
            figures,
            sizes=sizes,
            confidence=each,
            name=name,
            resamples=resamples,
            seed=seed,
        )
        for name, figures in candidates.items()
    )


# --- several operations, and drift -------------------------------------------------------------


def judge_ops(
    baseline: Mapping[str, Mapping[int, Sequence[float]]],
    candidate: Mapping[str, Mapping[int, Sequence[float]]],
    *,
    matter: Mapping[str, Iterable[int]],
    confidence: float = 0.95,
    name: str = "candidate",
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Verdict:
    """`judge` over several operations ({op: {size: rounds}}): adopted when it is faster beyond
    the noise at every size that matters of every operation that matters (`matter`: {op:
    sizes}; an operation not named there only must not be slower) and slower nowhere.
    Each change carries its operation in `op`."""
    if set(baseline) != set(candidate):
        raise MeasurementError(f"the baseline and {name} were not measured on the same operations")
    unknown = sorted(set(matter) - set(baseline))
    if unknown:
        raise MeasurementError(f"operations that matter were not measured: {', '.join(unknown)}")
    if not any(tuple(sizes) for sizes in matter.values()):
        raise MeasurementError("no sizes that matter")
    changes: list[SizeChange] = []
    for op in sorted(baseline):
        sizes = tuple(matter.get(op, ()))
        verdict = judge(
            baseline[op],
            candidate[op],
            sizes=sizes or None,
            confidence=confidence,
            name=name,
            resamples=resamples,
            seed=seed,
        )
        changes += [
            dataclasses.replace(c, matters=bool(sizes) and c.matters, op=op)
            for c in verdict.changes
        ]
    mattering = [c for c in changes if c.matters]
    slower_elsewhere = [c for c in changes if c.slower and not c.matters]
    return Verdict(
        candidate=name,
        adopt=all(c.faster for c in mattering) and not slower_elsewhere,
        confidence=confidence,
        rounds=min(len(v) for figures in baseline.values() for v in figures.values()),
        changes=tuple(changes),
        reasons=tuple(c.describe() for c in mattering + slower_elsewhere),
    )


def judge_drift(
    reference: Mapping[str, Mapping[int, Sequence[float]]],
    now: Mapping[str, Mapping[int, Sequence[float]]],
    *,
    matter: Mapping[str, Iterable[int]],
    confidence: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Verdict:
    """Whether the same settings measured later (`now`) are slower than when they were
    adopted (`reference`) beyond the noise. The two runs' rounds are not paired (they ran
    days apart), so each size's change is the log ratio of the two medians, with a
    bootstrap that resamples each run's rounds on its own. `adopt` here means "drifted":
    slower beyond the noise at some size that matters."""
    rng = random.Random(f"drift:{seed}")  # noqa: S311 (a seeded statistic)
    changes: list[SizeChange] = []
    tail = (1 - confidence) / 2
    for op in sorted(set(reference) & set(now)):
        sizes = set(matter.get(op, ()))
        for size in sorted(set(reference[op]) & set(now[op])):
            before = _rounds({size: reference[op][size]}, "the reference")[size]
            after = _rounds({size: now[op][size]}, "the drift check")[size]
            mid = math.log(statistics.median(after) / statistics.median(before))
            boot = sorted(
                math.log(
                    statistics.median(rng.choices(after, k=len(after)))
                    / statistics.median(rng.choices(before, k=len(before)))
                )
                for _ in range(resamples)
            )
            low = boot[math.floor(tail * (resamples - 1))]
            high = boot[math.ceil((1 - tail) * (resamples - 1))]
            pct = [100 * math.expm1(x) for x in (mid, low, high)]
            changes.append(SizeChange(size, *pct, matters=size in sizes, op=op))
    if not changes:
        raise MeasurementError("the drift check and its reference share no measured size")
    slower = [c for c in changes if c.matters and c.slower]
    return Verdict(
        candidate="drift check",
        adopt=bool(slower),
        confidence=confidence,
        rounds=min(len(v) for figures in now.values() for v in figures.values()),
        changes=tuple(changes),
        reasons=tuple(c.describe() for c in slower)
        or ("within the noise of the adopted figures at every size that matters",),
    )
