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
from apps.fleet.fabric import node_fabric_measured_ok, node_fabric_measured_slow
from apps.fleet.models import NodeState
from apps.fleet.selectors import (
    nodes_back_from_repair,
    nodes_measured_slow,
    nodes_named,
    pool_by_key,
    pool_nodes_in,
)
from apps.jobs.models import Job, JobEvent, JobKind, JobState
from apps.jobs.services import job_cancel
from apps.jobs.transitions import actor_label, schedule_soon
from apps.tuning import runs as tuning
from apps.tuning.models import (
    BISECT_AGAINST_GOOD,
    BISECT_PAIRS,
    BISECT_REPAIRED,
    TuningRunKind,
    TuningRunState,
)
from apps.tuning.selectors import (
    pools_nccl,
    tuning_pools_busy,
    tuning_references_latest,
    tuning_run_get,
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


# --- bisection: which nodes made a pool slower ----------------------------------------------------


def _check(parent, nodes: list[str], step: int):
    """A drift check of `nodes` (names) on the parent's settings and sizes, as its child."""
    reference = parent.reference
    return tuning_run_start(
        pool=parent.pool_id,
        by=None,
        nodes=nodes,
        team=parent.job.team_id if parent.job_id else settings.TUNING_DRIFT_TEAM,
        kind=TuningRunKind.DRIFT,
        reference=reference,
        rounds=parent.rounds,
        ops=list(parent.ops),
        sizes=list(parent.sizes),
        sizes_that_matter=list(parent.sizes_that_matter),
        warmup=parent.warmup,
        iters=parent.iters,
        parent=parent,
        step=step,
    )


def _pairs(names: list[str]) -> list[list[str]]:
    """Disjoint pairs; an odd one out goes with the first."""
    pairs = [names[i : i + 2] for i in range(0, len(names) - 1, 2)]
    if len(names) % 2:
        pairs.append([names[-1], names[0]])
    return pairs


def _ready_outside(run) -> list[str]:
    """The run's pool's ready nodes that it did not measure and no check marked slow."""
    slow = nodes_measured_slow(pool_id=run.pool_id)
    return [
        n.name
        for n in pool_nodes_in(pool_id=run.pool_id, states=(NodeState.READY,))
        if n.pk not in slow and n.pk not in run.node_ids
    ]


def drift_followup(run_id: int) -> dict:
    """After a drift check is judged: bisect a drop down to the nodes behind it, and mark
    them (their fabric is degraded, so the scheduler keeps multi-node jobs off them while
    healthy nodes are free; apps/fleet/fabric.py).

    A drop over three or more nodes → each pair of them measured apart. Once every pair
    has ended, the nodes of steady pairs are good, and each node of a slow pair is measured
    again beside a good one (or beside a ready node of the pool that was not measured, when
    no pair was steady; with none, no node is to blame more than another and only the
    pool's check says it drifted). A node slow beside a good one is marked; a single node's
    drop marks it. A node back from repair, measured beside a good one, is marked again or
    cleared by that check.
    """
    run = tuning_run_get(run_id=run_id)
    done = {"started": 0, "marked": [], "cleared": []}
    if run.kind != TuningRunKind.DRIFT or run.state not in (
        TuningRunState.DRIFTED,
        TuningRunState.STEADY,
    ):
        return done
    slow = run.state == TuningRunState.DRIFTED
    why = f"drift check #{run.pk}: {run.state_reason}"
    if run.step in (BISECT_AGAINST_GOOD, BISECT_REPAIRED) or len(run.node_ids) == 1:
        # The first node is the one in question; a second is known good.
        suspect, name = run.node_ids[0], run.node_names[0]
        changed = (
            node_fabric_measured_slow(node_id=suspect, reason=why)
            if slow
            else node_fabric_measured_ok(node_id=suspect, reason=why)
        )
        if changed:
            done["marked" if slow else "cleared"].append(name)
        return done
    if run.step == 0:
        if not slow:
            return done
        if len(run.node_names) > 2:
            for pair in _pairs(list(run.node_names)):
                _check(run, pair, BISECT_PAIRS)
                done["started"] += 1
            return done
        suspects, good = list(run.node_names), _ready_outside(run)
        parent = run
    else:
        parent = run.parent
        siblings = [r for r in parent.children.all() if r.step == BISECT_PAIRS]
        if any(not r.finished for r in siblings):
            return done
        good = [n for r in siblings if r.state == TuningRunState.STEADY for n in r.node_names]
        suspects = sorted(
            {n for r in siblings if r.state == TuningRunState.DRIFTED for n in r.node_names}
            - set(good)
        )
        good = good or _ready_outside(parent)
    if not good:
        return done
    for name in suspects:
        _check(parent, [name, good[0]], BISECT_AGAINST_GOOD)
        done["started"] += 1
    return done


def repaired_nodes_check() -> int:
    """A node a drift check marked slow that ops drained and have since returned to work
    (after its repair) is measured beside a good node of its pool: steady clears the mark."""
    if not settings.TUNING_DRIFT_TEAM:
        return 0
    started = 0
    busy = tuning_pools_busy()
    for pool_id, last in tuning_references_latest(states=REFERENCE_STATES).items():
        back = nodes_back_from_repair(pool_id=pool_id)
        if pool_id in busy or not back:
            continue
        slow = nodes_measured_slow(pool_id=pool_id)
        good = [
            n.name
            for n in pool_nodes_in(pool_id=pool_id, states=(NodeState.READY,))
            if n.pk not in slow
        ]
        if not good:
            continue
        reference = last if last.kind == TuningRunKind.TUNING else (last.reference or last)
        try:
            tuning_run_start(
                pool=pool_id,
                by=None,
                nodes=[back[0], good[0]],  # one per pool at a time: the good node is pinned too
                team=settings.TUNING_DRIFT_TEAM,
                kind=TuningRunKind.DRIFT,
                reference=reference,
                rounds=reference.rounds,
                ops=list(reference.ops),
                sizes=list(reference.sizes),
                sizes_that_matter=list(reference.sizes_that_matter),
                warmup=reference.warmup,
                iters=reference.iters,
                step=BISECT_REPAIRED,
            )
            started += 1
        except ApplicationError:
            continue
    return started
