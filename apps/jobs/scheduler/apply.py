"""Apply one pass's decisions in one transaction, in bulk: placements, preemptions, reasons.

Everything the planner saw may have changed since the read (a job cancelled, a
node drained): the rows are locked and checked again here, and a placement that
no longer fits is skipped (the next pass places it), never half-applied.
"""

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.db.models import Sum
from django.utils import timezone

from apps.accounts.services import audit_record_many
from apps.fleet import services as fleet
from apps.fleet.models import Node, NodeState
from apps.jobs.models import Allocation, Job, JobEvent, JobState, TeamUsage
from apps.jobs.scheduler import snapshot as plain
from apps.jobs.scheduler.read import ReadContext, decayed

SCHEDULABLE = (NodeState.READY, NodeState.BUSY)
NOT_STARTED = (JobState.ADMITTED, JobState.PROVISIONING)
STARTED = (JobState.STARTING, JobState.RUNNING)


@dataclass
class Applied:
    placed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    reasons_written: int = 0


def _events_and_audit(rows: list[tuple[int, str, str, str]], *, now: dt.datetime) -> None:
    """rows: (job id, from, to, reason) → JobEvents and audit rows, two bulk inserts."""
    if not rows:
        return
    JobEvent.objects.bulk_create(
        [
            JobEvent(job_id=j, from_state=f, to_state=t, reason=r[:300], actor_label="scheduler")
            for j, f, t, r in rows
        ],
        batch_size=1000,
    )
    jobs = Job.objects.in_bulk([j for j, _, _, _ in rows])
    by_action: dict[str, list] = defaultdict(list)
    for j, f, t, r in rows:
        by_action[f"job.{t}"].append((jobs[j], {"state": f}, {"state": t, "reason": r[:300]}))
    for action, changes in by_action.items():
        audit_record_many(actor=None, action=action, changes=changes)


def _apply_placements(placements: list[plain.Placement], *, now, applied: Applied) -> None:
    if not placements:
        return
    wanted = {p.job_id: p for p in placements}
    still_pending = set(
        Job.objects.select_for_update()
        .filter(pk__in=wanted, state=JobState.PENDING)
        .values_list("id", flat=True)
    )
    node_ids = {node_id for p in placements for node_id, _ in p.node_gpus}
    nodes = {
        node_id: (state, gpus)
        for node_id, state, gpus in Node.objects.select_for_update()
        .filter(pk__in=node_ids)
        .values_list("id", "state", "gpu_count")
    }
    held = dict(
        Allocation.objects.filter(node_id__in=node_ids, ended_at__isnull=True)
        .values_list("node_id")
        .annotate(held=Sum("gpus"))
        .order_by()
    )
    accepted: list[plain.Placement] = []
    for placement in placements:
        fits = placement.job_id in still_pending and all(
            node_id in nodes
            and nodes[node_id][0] in SCHEDULABLE
            and held.get(node_id, 0) + gpus <= nodes[node_id][1]
            for node_id, gpus in placement.node_gpus
        )
        if not fits:
            applied.skipped.append(placement.job_id)
            continue
        for node_id, gpus in placement.node_gpus:
            held[node_id] = held.get(node_id, 0) + gpus
        accepted.append(placement)
    if not accepted:
        return
    Allocation.objects.bulk_create(
        [
            Allocation(job_id=p.job_id, node_id=node_id, gpus=gpus, started_at=now)
            for p in accepted
            for node_id, gpus in p.node_gpus
        ],
        batch_size=1000,
    )
    by_pool: dict[tuple[int, bool], list[int]] = defaultdict(list)
    for p in accepted:
        by_pool[(p.pool_id, p.backfilled)].append(p.job_id)
    for (pool_id, backfilled), job_ids in by_pool.items():
        Job.objects.filter(pk__in=job_ids).update(
            state=JobState.ADMITTED,
            pool_id=pool_id,
            admitted_at=now,
            pending_reason="",
            estimated_start=None,
            state_reason="placed (backfilled)" if backfilled else "placed",
        )
    fleet.nodes_work_started(node_ids=sorted({n for p in accepted for n, _ in p.node_gpus}))
    _events_and_audit(
        [
            (
                p.job_id,
                JobState.PENDING,
                JobState.ADMITTED,
                "placed (backfilled)" if p.backfilled else "placed",
            )
            for p in accepted
        ],
        now=now,
    )
    applied.placed.extend(p.job_id for p in accepted)


def _apply_preemptions(preemptions: list[plain.Preemption], *, now, applied: Applied) -> None:
    if not preemptions:
        return
    from apps.jobs.services import _release_allocations

    reasons = {p.job_id: p.reason for p in preemptions}
    victims = list(
        Job.objects.select_for_update()
        .filter(pk__in=reasons, state__in=(*NOT_STARTED, *STARTED))
        .values_list("id", "state")
    )
    # Not started yet: nothing to checkpoint, straight back to the queue.
    back = [job_id for job_id, state in victims if state in NOT_STARTED]
    # Running: checkpoint first, then stop (PREEMPTING → PENDING, by the agent or the reconcile).
    stopping = [job_id for job_id, state in victims if state in STARTED]
    if back:
        Job.objects.filter(pk__in=back).update(
            state=JobState.PENDING,
            pool=None,
            state_reason="preempted before it started",
            pending_reason="preempted; waiting for the next scheduling pass",
        )
        _release_allocations(back, now=now)
    if stopping:
        Job.objects.filter(pk__in=stopping).update(
            state=JobState.PREEMPTING,
            state_reason="preempted: checkpoint, then stop",
            state_changed_at=now,
        )
    _events_and_audit(
        [
            (
                job_id,
                state,
                JobState.PENDING if state in NOT_STARTED else JobState.PREEMPTING,
                reasons[job_id],
            )
            for job_id, state in victims
        ],
        now=now,
    )
    applied.preempted.extend(job_id for job_id, _ in victims)


def _apply_reasons(waits: dict[int, plain.Wait], ctx: ReadContext, applied: Applied) -> None:
    """Write only the reasons that changed since the last pass."""
    placed = set(applied.placed)
    changed: list[tuple[int, str, dt.datetime | None]] = []
    for job_id, wait in waits.items():
        if job_id in placed or job_id not in ctx.reasons:
            continue
        estimated = (
            dt.datetime.fromtimestamp(wait.estimated_start, tz=dt.UTC).replace(
                second=0, microsecond=0
            )
            if wait.estimated_start is not None
            else None
        )
        reason = wait.reason[:300]
        if (reason, estimated) != ctx.reasons[job_id]:
            changed.append((job_id, reason, estimated))
    _write_reasons(changed)
    applied.reasons_written = len(changed)


def _write_reasons(rows: list[tuple[int, str, dt.datetime | None]]) -> None:
    if not rows:
        return
    if connection.vendor == "postgresql":
        # One UPDATE ... FROM (VALUES ...) per chunk: thousands of rows a statement.
        table = Job._meta.db_table
        for start in range(0, len(rows), 5000):
            chunk = rows[start : start + 5000]
            values = ", ".join(["(%s::bigint, %s::varchar, %s::timestamptz)"] * len(chunk))
            params = [item for row in chunk for item in row]
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE {table} AS j SET pending_reason = v.reason, "  # noqa: S608
                    "estimated_start = v.estimated "
                    f"FROM (VALUES {values}) AS v(id, reason, estimated) WHERE j.id = v.id",
                    params,
                )
        return
    # Elsewhere: one UPDATE per distinct (reason, start); many jobs share a reason.
    groups: dict[tuple[str, dt.datetime | None], list[int]] = defaultdict(list)
    for job_id, reason, estimated in rows:
        groups[(reason, estimated)].append(job_id)
    for (reason, estimated), job_ids in groups.items():
        for start in range(0, len(job_ids), 900):
            Job.objects.filter(pk__in=job_ids[start : start + 900]).update(
                pending_reason=reason, estimated_start=estimated
            )


def _advance_usage(ctx: ReadContext) -> None:
    """Decay every team's usage to now and add what it held since the last pass."""
    now = ctx.now
    rows = {u.team_id: u for u in TeamUsage.objects.select_for_update()}
    updates = []
    for team_id, usage in rows.items():
        since = usage.updated_at
        elapsed = max((now - since).total_seconds(), 0.0)
        usage.gpu_seconds = decayed(usage.gpu_seconds, since=since, now=now) + (
            ctx.held_by_team.get(team_id, 0) * elapsed
        )
        usage.updated_at = now
        updates.append(usage)
    TeamUsage.objects.bulk_update(updates, ["gpu_seconds", "updated_at"], batch_size=1000)
    TeamUsage.objects.bulk_create(
        [
            TeamUsage(team_id=team_id, gpu_seconds=0.0, updated_at=now)
            for team_id in ctx.held_by_team
            if team_id not in rows
        ],
        ignore_conflicts=True,
    )


@transaction.atomic
def decisions_apply(decisions: plain.Decisions, ctx: ReadContext) -> Applied:
    now = ctx.now or timezone.now()
    applied = Applied()
    _apply_placements(decisions.placements, now=now, applied=applied)
    _apply_preemptions(decisions.preemptions, now=now, applied=applied)
    _apply_reasons(decisions.waits, ctx, applied)
    _advance_usage(ctx)
    return applied
