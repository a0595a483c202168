"""Starting NCCL tuning runs as jobs: the run's plan (apps/tuning/runs.py) and its job, which the
scheduler places like any other on exactly the nodes the run names (Job.node_ids) and which
holds them while it measures. Here because a job is the jobs app's, which sits above tuning.
"""

import datetime as dt
import json

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.selectors import first_team_of, roles_of, team_by_key
from apps.accounts.services import audit_record, snapshot
from apps.fleet.models import NodeState
from apps.fleet.selectors import nodes_named, pool_by_key, pool_nodes_in
from apps.jobs.models import Job, JobEvent, JobKind, JobState
from apps.jobs.services import job_cancel
from apps.jobs.transitions import actor_label, schedule_soon
from apps.tuning import runs as tuning
from apps.tuning.models import TuningRunKind, TuningRunState
from apps.tuning.selectors import (
    pools_nccl,
    tuning_pools_busy,
    tuning_references_latest,
    tuning_run_of_job,
)
from controlplane.errors import ApplicationError

# The nodes a run measures when ops name none: those of the pool that take work now.
MEASURABLE = (NodeState.READY, NodeState.BUSY)
PLAN_FILE = "tuning.json"


def _pool(pool):
    found = pool_by_key(pool)
    if found is None:
        raise ApplicationError("No such pool.", details={"pool": [f"No pool {pool}."]})
    return found


def _nodes(pool, names: list[str] | None) -> list:
    if names:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ApplicationError("Invalid nodes.", details={"nodes": ["A list of node names."]})
        found = nodes_named(names=names)
        problems = [f"{name}: no such node" for name in names if name not in found]
        problems += [
            f"{name}: in pool {found[name].pool_id}, not {pool.slug}"
            for name in names
            if name in found and found[name].pool_id != pool.pk
        ]
        if problems:
            raise ApplicationError("Invalid nodes.", details={"nodes": problems})
        nodes = [found[name] for name in dict.fromkeys(names)]
    else:
        nodes = pool_nodes_in(pool_id=pool.pk, states=MEASURABLE)
        if not nodes:
            raise ApplicationError(
                "Nothing to measure.",
                details={"nodes": [f"Pool {pool.slug} has no node that is ready or busy."]},
            )
    counts = {n.gpu_count for n in nodes}
    if len(counts) != 1:
        raise ApplicationError(
            "Invalid nodes.", details={"nodes": ["The nodes measured together have as many GPUs."]}
        )
    return nodes


def _team(team, by):
    if team is not None:
        found = team_by_key(team)
        if found is None:
            raise ApplicationError("No such team.", details={"team": [f"No team {team}."]})
        return found
    mine = first_team_of(user=by)
    if mine is None:
        raise ApplicationError(
            "Name a team.", details={"team": ["The team whose GPU time the run counts to."]}
        )
    return mine


@transaction.atomic
def tuning_run_start(
    *,
    pool,
    by,
    nodes: list[str] | None = None,
    team=None,
    kind: str = TuningRunKind.TUNING,
    priority: str = "normal",
    reference=None,
    **plan,
):
    """Plan a tuning run on `pool` (a slug or id) and queue its job, pinned to `nodes` (names;
    none: every ready or busy node of the pool). `plan`: candidates, rounds, ops, sizes,
    sizes_that_matter, approval_required, limit, warmup, iters, seed (apps/tuning/runs.py)."""
    if by is not None and not roles_of(by).manages_fleet:
        raise ApplicationError("Only ops run NCCL tuning.", code="permission_denied", status=403)
    if priority not in ("low", "normal", "high", "urgent"):
        raise ApplicationError(
            "Invalid priority.", details={"priority": ["low, normal, high or urgent."]}
        )
    found = _pool(pool)
    chosen = _nodes(found, nodes)
    owner = _team(team, by)
    run = tuning.tuning_run_create(
        kind=kind,
        pool=pools_nccl(pool_ids=[found.pk])[0],
        nodes=[(n.pk, n.name) for n in chosen],
        gpus_per_node=chosen[0].gpu_count,
        by=by,
        reference=reference,
        **plan,
    )
    now = timezone.now()
    word = "tuning" if kind == TuningRunKind.TUNING else "drift"
    person = by if by is not None and by.pk else None
    job = Job.objects.create(
        name=f"nccl-{word}-{found.slug}"[:100],
        team=owner,
        submitted_by=person,
        priority_class=priority,
        kind=JobKind.TUNING,
        spec={"name": f"nccl-{word}-{found.slug}", "tuning_run": run.pk, "pool": found.slug},
        gpu_type=found.gpu_type,
        nodes=len(chosen),
        gpus_per_node=chosen[0].gpu_count,
        dp_shard=len(chosen) * chosen[0].gpu_count,
        placement="cloud" if found.kind == "cloud" else "owned",
        node_ids=[n.pk for n in chosen],
        time_limit_s=min(tuning.time_limit_s(run), 30 * 86400),
        restart_limit=1,
        queued_at=now,
    )
    JobEvent.objects.create(
        job=job,
        from_state="",
        to_state=JobState.PENDING,
        reason=f"tuning run #{run.pk}",
        actor=person,
        actor_label=actor_label(by),
    )
    audit_record(actor=by, action="job.submit", obj=job, after=snapshot(job), team=owner)
    run.job = job
    run.save(update_fields=["job"])
    schedule_soon()
    return run


def tuning_plan_file(job: Job) -> dict:
    """The driver's plan file for a tuning job's nodes (apps/jobs/dispatch.py run_plan)."""
    run = tuning_run_of_job(job_id=job.pk)
    return {"path": PLAN_FILE, "content": json.dumps(tuning.driver_plan(run))}


def tuning_run_cancel(*, run, by):
    """Cancel the run's job; the run follows it (CANCELLED)."""
    if by is not None and not roles_of(by).manages_fleet:
        raise ApplicationError("Only ops run NCCL tuning.", code="permission_denied", status=403)
    if (
        run.finished
        or run.job_id is None
        or run.state
        not in (
            TuningRunState.QUEUED,
            TuningRunState.RUNNING,
        )
    ):
        raise ApplicationError(
            f"Tuning run {run.pk} is {run.get_state_display().lower()}: nothing to cancel.",
            code="invalid_transition",
            status=409,
        )
    job_cancel(job=run.job, by=by, reason=f"tuning run #{run.pk} cancelled by {actor_label(by)}")
    run.refresh_from_db()
    return run


# --- drift checks ---------------------------------------------------------------------------------

REFERENCE_STATES = (TuningRunState.ADOPTED, TuningRunState.NOTHING_ADOPTED, TuningRunState.STEADY)


def drift_checks_start(*, now: dt.datetime | None = None) -> int:
    """Re-measure each pool's settings once its last measurement is TUNING_DRIFT_EVERY_S
    old, on the nodes that measurement used, counted to TUNING_DRIFT_TEAM (no team: off).
    A pool with a run not finished gets none."""
    team = settings.TUNING_DRIFT_TEAM
    if not team:
        return 0
    now = now or timezone.now()
    due = now - dt.timedelta(seconds=settings.TUNING_DRIFT_EVERY_S)
    busy = tuning_pools_busy()
    latest = tuning_references_latest(states=REFERENCE_STATES)
    started = 0
    for pool_id, run in latest.items():
        if pool_id in busy or run.finished_at is None or run.finished_at > due:
            continue
        reference = run if run.kind == TuningRunKind.TUNING else (run.reference or run)
        try:
            tuning_run_start(
                pool=pool_id,
                by=None,
                nodes=list(run.node_names),
                team=team,
                kind=TuningRunKind.DRIFT,
                reference=reference,
                rounds=run.rounds,
                ops=list(run.ops),
                sizes=list(run.sizes),
                sizes_that_matter=list(run.sizes_that_matter),
                warmup=run.warmup,
                iters=run.iters,
            )
            started += 1
        except ApplicationError:
            continue  # its nodes are gone or its profile no longer lints: ops see the pool
    return started
