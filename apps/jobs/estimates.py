"""When each pending job may start: a simple model for the Queue page (standard library only).

The scheduler reserves an earliest start for the first jobs it cannot place in each pool
(EASY backfill, apps/jobs/scheduler/plan.py) and for none past its backfill depth. For
every other pending job this model gives an estimate a reader can follow:

- the GPUs of each type on schedulable nodes are one pool of that size;
- the GPUs held now come back when their job reaches its time limit (start plus limit);
- the pending jobs take GPUs in queue order, first come first served: a job starts when
  enough GPUs of its type are free and not before the job ahead of it of that type, and
  holds them for its whole time limit;
- a job of any GPU type counts against every GPU, behind every job ahead of it.

So an estimate is what time limits allow if nothing jumps the queue: it leans late where
the scheduler backfills a small job into a gap and where jobs end early, and early where
GPUs are split across nodes, quotas or windows hold a job back, or cloud nodes would
start. A scheduler's reservation is shown as it is (the model books the job from then, not
before). A job that needs more GPUs than there are of its type has no estimate.
"""

import heapq
from typing import NamedTuple

from apps.jobs.scheduler.snapshot import ANY_GPU


class Queued(NamedTuple):
    """A pending job, as the model sees it."""

    job_id: int
    gpu_type: str  # or ANY_GPU
    gpus: int
    time_limit_s: int
    reserved_at: float | None = None  # the scheduler's reserved start (epoch seconds)


class Estimate(NamedTuple):
    start: float | None  # epoch seconds; None: nothing bounds it
    basis: str  # what the estimate rests on, in words (the page's tooltip)


class _GpuPool:
    """GPUs of one type over time, walked forward: how many are free at `at`, and when held
    ones come back."""

    def __init__(self, *, size: int, releases, now: float):
        self.size = size
        self.at = now
        self.heap = [(max(when, now), gpus) for when, gpus in releases]
        heapq.heapify(self.heap)
        self.free = size - sum(gpus for _, gpus in self.heap)

    def take(self, gpus: int, time_limit_s: int, not_before: float) -> float | None:
        """The earliest time from `not_before` (and not before the job ahead) at which
        `gpus` are free, booked for the time limit; None if there never are."""
        if gpus > self.size:
            return None
        start = max(self.at, not_before)
        while self.heap and (self.heap[0][0] <= start or self.free < gpus):
            when, back = heapq.heappop(self.heap)
            start = max(start, when)
            self.free += back
        if self.free < gpus:  # GPUs held beyond the pool's size (nodes left it): never
            return None
        self.at = start
        self.free -= gpus
        heapq.heappush(self.heap, (start + time_limit_s, gpus))
        return start


RESERVED = (
    "Reserved by the scheduler: the nodes it needs are free then, as running jobs reach "
    "their time limits."
)


def _gpus_word(job: Queued) -> str:
    return f"{job.gpus} GPUs" if job.gpu_type == ANY_GPU else f"{job.gpus} {job.gpu_type} GPUs"


def _basis(job: Queued, ahead: int) -> str:
    jobs = "job" if ahead == 1 else "jobs"
    of_type = "" if job.gpu_type == ANY_GPU else " of this type"
    return (
        f"When {_gpus_word(job)} are free if running jobs and the {ahead} pending {jobs} "
        f"ahead of it{of_type} run to their time limits, in queue order."
    )


def _never(job: Queued) -> str:
    return (
        f"No start can be estimated: the schedulable nodes have fewer than {_gpus_word(job)} "
        "in all."
    )


def estimate_starts(
    queue: list[Queued],
    *,
    now: float,
    capacity: dict[str, int],
    releases: dict[str, list[tuple[float, int]]],
) -> dict[int, Estimate]:
    """Each queued job's estimate (queue in queue order): `capacity` is the GPUs of each type
    on schedulable nodes, `releases` the (time limit reached, GPUs) of the GPUs held there."""
    pools = {
        gpu_type: _GpuPool(size=size, releases=releases.get(gpu_type, ()), now=now)
        for gpu_type, size in capacity.items()
    }
    every = _GpuPool(
        size=sum(capacity.values()),
        releases=[r for gpu_type in capacity for r in releases.get(gpu_type, ())],
        now=now,
    )
    ahead: dict[str, int] = {}
    out = {}
    for job in queue:
        reserved = job.reserved_at is not None and job.reserved_at >= now
        not_before = job.reserved_at if reserved else now
        if job.gpu_type == ANY_GPU:
            start = every.take(job.gpus, job.time_limit_s, not_before)
            behind = sum(ahead.values())
        else:
            pool = pools.get(job.gpu_type)
            start = pool.take(job.gpus, job.time_limit_s, not_before) if pool else None
            if start is not None:  # it holds some of every GPU from then (for ANY jobs)
                every.take(job.gpus, job.time_limit_s, start)
            behind = ahead.get(job.gpu_type, 0)
        if start is None:  # it holds nothing, and nobody waits behind it
            out[job.job_id] = Estimate(None, _never(job))
            continue
        ahead[job.gpu_type] = ahead.get(job.gpu_type, 0) + 1
        if reserved:  # the scheduler's word, shown as it is
            out[job.job_id] = Estimate(job.reserved_at, RESERVED)
        else:
            out[job.job_id] = Estimate(start, _basis(job, behind))
    return out
