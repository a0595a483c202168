"""Reads of NCCL profiles, and of what the pools say about their nodes' NCCL."""

from dataclasses import dataclass

from django.db.models import QuerySet

from apps.fleet.selectors import pools_for_listing
from apps.tuning.models import (
    ANY_FABRIC,
    TUNING_FINISHED,
    NcclProfile,
    NcclProfileVersion,
    TuningRun,
    TuningRunEvent,
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


def profile_versions(*, profile: NcclProfile) -> list[NcclProfileVersion]:
    """A profile's versions, newest first, with who made each and the run that chose it."""
    return list(
        NcclProfileVersion.objects.filter(profile=profile)
        .select_related("made_by", "tuning_run")
        .order_by("-number")
    )


def profile_version_get(*, profile_name: str, number: int) -> NcclProfileVersion | None:
    return (
        NcclProfileVersion.objects.select_related("profile")
        .filter(profile__name=profile_name, number=number)
        .first()
    )
