"""Reads of NCCL profiles, and of what the pools say about their nodes' NCCL."""

import statistics
from collections import defaultdict
from dataclasses import dataclass

from django.db.models import QuerySet
from django.utils import timezone

from apps.fleet.selectors import pools_for_listing
from apps.tuning.models import (
    ANY_FABRIC,
    TUNING_FINISHED,
    NcclProfile,
    NcclProfileVersion,
    TuningMeasurement,
    TuningRun,
    TuningRunEvent,
    TuningRunState,
    parse_version,
)


def profiles_visible() -> QuerySet[NcclProfile]:
    """Every profile: anyone signed in reads them (jobs name them)."""
    return NcclProfile.objects.select_related("updated_by", "pool").order_by("name")


def profiles_all() -> list[NcclProfile]:
    """The whole (small) table, for choosing and rendering in memory."""
    return list(NcclProfile.objects.order_by("name"))


@dataclass(frozen=True)
class PoolNccl:
    """What a pool says of its nodes until they report it: fabric and NCCL version."""

    pool_id: int
    slug: str
    name: str
    kind: str
    fabric: str  # "" when unknown
    nccl_version: str  # "" when unknown


def pools_nccl(*, pool_ids: list[int] | None = None) -> list[PoolNccl]:
    pools = pools_for_listing()
    if pool_ids is not None:
        if not pool_ids:
            return []
        pools = pools.filter(pk__in=pool_ids)
    rows = pools.values_list("id", "slug", "name", "kind", "fabric", "nccl_version")
    return [PoolNccl(*row) for row in rows]


def default_profile(
    profiles: list[NcclProfile], *, fabric: str, nccl_version: str, single_node: bool
) -> NcclProfile | None:
    """The profile a job that names none gets on such nodes.

    Among default profiles of the right scope (single-node or not) whose version range
    holds the NCCL version: one for this very fabric before one for any fabric, then the
    one made for the newest NCCL, then by name (so the answer never depends on row order).
    """
    candidates = [
        p
        for p in profiles
        if p.is_default
        and p.single_node == single_node
        and (p.fabric == ANY_FABRIC or (fabric and p.fabric == fabric))
        and p.fits(nccl_version)
    ]
    if not candidates and single_node:
        return default_profile(
            profiles, fabric=fabric, nccl_version=nccl_version, single_node=False
        )

    def rank(profile: NcclProfile):
        return (profile.fabric != ANY_FABRIC, parse_version(profile.min_nccl_version), profile.name)

    return max(candidates, key=rank, default=None)


def tuning_run_of_job(*, job_id: int) -> TuningRun:
    return TuningRun.objects.get(job_id=job_id)


def tuning_pools_busy() -> set[int]:
    """Pools with a tuning run not finished."""
    return set(
        TuningRun.objects.exclude(state__in=TUNING_FINISHED).values_list("pool_id", flat=True)
    )


def tuning_references_latest(*, states) -> dict[int, TuningRun]:
    """Each pool's newest finished run in `states`, by pool id."""
    latest = {}
    for run in TuningRun.objects.filter(state__in=list(states)).order_by("pool_id", "-finished_at"):
        latest.setdefault(run.pool_id, run)
    return latest


def tuning_run_get(*, run_id: int) -> TuningRun:
    return TuningRun.objects.select_related("parent", "reference", "job").get(pk=run_id)


# --- what the API and cpctl show of tuning runs and profile versions -------------------------


def tuning_runs_visible() -> QuerySet[TuningRun]:
    """Every tuning run, newest first: anyone signed in reads them, as they read the NCCL
    profiles the runs choose."""
    return TuningRun.objects.select_related(
        "pool", "adopted_version__profile", "created_by", "decided_by"
    ).order_by("-created_at", "-id")


def tuning_run_progress(run: TuningRun, *, now=None) -> dict:
    """Launches done of the plan's total, and the time left while it runs, at the pace so
    far (from `started_at`): null before the first launch is done and once it stops running."""
    done, total = run.launches_done, run.launches_total
    eta = None
    if run.state == TuningRunState.RUNNING and run.started_at is not None and done:
        elapsed = ((now or timezone.now()) - run.started_at).total_seconds()
        eta = max(0, round(elapsed * (total - done) / done))
    return {
        "done": done,
        "total": total,
        "percent": round(100 * done / total, 1) if total else 0.0,
        "eta_s": eta,
    }


def tuning_run_figures(*, run: TuningRun) -> list[dict]:
    """Per candidate, operation and size (in the plan's order): each round's bus bandwidth
    (None for a round with no figure) and the median of those it has (one query)."""
    rounds: dict[tuple, list] = defaultdict(lambda: [None] * run.rounds)
    for candidate, op, size, round_, busbw in (
        TuningMeasurement.objects.filter(run=run)
        .order_by()
        .values_list("candidate", "op", "bytes", "round", "busbw_gbps")
    ):
        rounds[candidate, op, size][round_] = busbw
    labels = {c["index"]: c["label"] for c in run.candidates}
    ops = {op: n for n, op in enumerate(run.ops)}
    rows = []
    for (candidate, op, size), values in sorted(
        rounds.items(), key=lambda item: (item[0][0], ops.get(item[0][1], 99), item[0][2])
    ):
        rows.append(
            {
                "candidate": candidate,
                "label": labels.get(candidate, ""),
                "baseline": candidate == 0,
                "op": op,
                "bytes": size,
                "median_busbw_gbps": statistics.median(v for v in values if v is not None),
                "busbw_gbps": values,
            }
        )
    return rows


def tuning_measurements_of(*, run: TuningRun) -> QuerySet[TuningMeasurement]:
    """Every figure of a run, by candidate, operation, size and round (its CSV)."""
    return TuningMeasurement.objects.filter(run=run).order_by("candidate", "op", "bytes", "round")


def profile_named(*, name: str) -> NcclProfile | None:
    return NcclProfile.objects.filter(name=name).first()


def profile_versions(*, profile: NcclProfile) -> QuerySet[NcclProfileVersion]:
    """A profile's versions, newest first."""
    return (
        NcclProfileVersion.objects.filter(profile=profile)
        .select_related("made_by", "profile", "tuning_run")
        .order_by("-number")
    )


# --- tuning runs and profile versions, for the pages ------------------------------------------


def tuning_runs_for_listing() -> QuerySet[TuningRun]:
    """Newest first, with what a row shows (pool, who started it, the profile measured and the
    version adopted) in the same query."""
    return TuningRun.objects.select_related(
        "pool", "created_by", "profile", "adopted_version__profile"
    ).order_by("-created_at", "-id")


def tuning_run_for_page(*, run_id: int) -> TuningRun | None:
    return (
        tuning_runs_for_listing()
        .select_related("job", "decided_by", "baseline_version")
        .filter(pk=run_id)
        .first()
    )


def tuning_run_events(*, run: TuningRun) -> list[TuningRunEvent]:
    return list(run.events.order_by("at", "id"))


def profile_version_get(*, profile_name: str, number: int) -> NcclProfileVersion | None:
    return (
        NcclProfileVersion.objects.select_related("profile")
        .filter(profile__name=profile_name, number=number)
        .first()
    )
