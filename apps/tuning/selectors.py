"""Reads of NCCL profiles, and of what the pools say about their nodes' NCCL."""

from dataclasses import dataclass

from django.db.models import QuerySet

from apps.fleet.selectors import pools_for_listing
from apps.tuning.models import (
    ANY_FABRIC,
    TUNING_FINISHED,
    NcclProfile,
    TuningRun,
    parse_version,
)


def profiles_visible() -> QuerySet[NcclProfile]:
    """Every profile: anyone signed in reads them (jobs name them)."""
    return NcclProfile.objects.select_related("updated_by").order_by("name")


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
