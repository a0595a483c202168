"""Apply one pass's decisions in one transaction, in bulk: placements, preemptions, reasons.

Everything the planner saw may have changed since the read (a job cancelled, a
node drained): the rows are locked and checked again here, and a placement that
no longer fits is skipped (the next pass places it), never half-applied.
"""

import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.utils import timezone

from apps.costs.selectors import BurstCost
from apps.fleet import cloud
from apps.fleet import services as fleet
from apps.fleet.models import SCHEDULABLE_STATES, Node
from apps.jobs.models import Allocation, Job, JobState, JobWait, TeamUsage
from apps.jobs.models.jobs import LAST_PASS_KEY, NOT_STARTED_STATES, STARTED_STATES, lowest_free
from apps.jobs.scheduler import snapshot as plain
from apps.jobs.scheduler.read import ReadContext, decay_scale
from apps.jobs.transitions import Move, jobs_move
from controlplane.bulk import InArray, fetch_rows, insert_rows, int_array
from controlplane.cache import best_effort
from controlplane.celery import enqueue_on_commit

log = logging.getLogger(__name__)


@dataclass
class Applied:
    placed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    reasons_written: int = 0
    burst_nodes: list[int] = field(default_factory=list)  # cloud nodes requested this pass


def _apply_placements(
    placements: list[plain.Placement], *, now, reasons: dict, applied: Applied
) -> None:
    """`reasons`: ReadContext.reasons, whose jobs with a wait row (not None) are the only
    placed jobs with one to delete: only the pass (under its lock) adds wait rows."""
    if not placements:
        return
    wanted = {p.job_id: p for p in placements}
    # Read in one fetch each (a first pass locks thousands of jobs and nodes).
    still_pending = dict(
        fetch_rows(
            Job.objects.select_for_update()
            .filter(InArray("id", wanted), state=JobState.PENDING)
            .values_list("id", "team_id")
        )
    )
    node_ids = {node_id for p in placements for node_id, _ in p.node_gpus}
    states, size = {}, {}
    room = {}  # node id -> GPUs free on it now, for schedulable nodes
    for node_id, state, gpus in fetch_rows(
        Node.objects.select_for_update()
        .filter(InArray("id", node_ids))
        .values_list("id", "state", "gpu_count")
    ):
        states[node_id] = state
        size[node_id] = gpus
        if state in SCHEDULABLE_STATES:
            room[node_id] = gpus
    used: dict[int, int] = defaultdict(int)  # node id -> mask of its GPUs held now
    for node_id, gpus, mask in fetch_rows(
        Allocation.objects.filter(InArray("node_id", room), ended_at__isnull=True).values_list(
            "node_id", "gpus", "gpu_slots"
        )
    ):
        room[node_id] -= gpus
        used[node_id] |= mask
    accepted: list[tuple[plain.Placement, list[tuple[int, int, int]]]] = []
    for placement in placements:
        if placement.job_id not in still_pending or not all(
            room.get(node_id, -1) >= gpus for node_id, gpus in placement.node_gpus
        ):
            applied.skipped.append(placement.job_id)
            continue
        # Which GPUs: the lowest free ones, so no two open allocations share one.
        slots = [
            (node_id, gpus, lowest_free(used[node_id], count=gpus, size=size[node_id]))
            for node_id, gpus in placement.node_gpus
        ]
        if not all(mask for _, _, mask in slots):
            applied.skipped.append(placement.job_id)
            continue
        for node_id, gpus, mask in slots:
            room[node_id] -= gpus
            used[node_id] |= mask
        accepted.append((placement, slots))
    if not accepted:
        return
    # Stamped now, with the nodes locked, not at the pass's start: GPUs another job let go
    # of since then were let go before this, so no node is ever booked past its GPUs.
    stamped = timezone.now()
    insert_rows(
        Allocation,
        ("job", "node", "gpus", "gpu_slots", "started_at", "ended_at", "release_wanted"),
        (
            (p.job_id, node_id, gpus, mask, stamped, None, False)
            for p, slots in accepted
            for node_id, gpus, mask in slots
        ),
    )
    by_pool: dict[tuple[int, bool], list[int]] = defaultdict(list)
    for p, _ in accepted:
        by_pool[(p.pool_id, p.backfilled)].append(p.job_id)
    for (pool_id, backfilled), job_ids in by_pool.items():
        reason = "placed (backfilled)" if backfilled else "placed"
        jobs_move(
            moves=[Move(j, still_pending[j], JobState.PENDING, reason) for j in job_ids],
            to=JobState.ADMITTED,
            by=None,
            now=now,
            pool_id=pool_id,
            admitted_at=now,
        )
    used_nodes = sorted({n for p, _ in accepted for n, _ in p.node_gpus})
    # Locked above: hand over which of them are READY rather than lock them again.
    fleet.nodes_work_started(ready=[(n, states[n]) for n in used_nodes if states[n] == "ready"])
    applied.placed.extend(p.job_id for p, _ in accepted)


def _apply_preemptions(preemptions: list[plain.Preemption], *, now, applied: Applied) -> None:
    """Victims not started yet go straight back to the queue (nothing to checkpoint);
    running ones are asked to checkpoint and stop (PREEMPTING), through the same road as
    any other state change, so their agents see the stop on their next poll. Their GPUs
    are let go only once their processes are gone (allocations_release); the job
    preempted for starts on them after that."""
    if not preemptions:
        return
    reasons = {p.job_id: p.reason for p in preemptions}
    victims = list(
        Job.objects.select_for_update()
        .filter(pk__in=reasons, state__in=NOT_STARTED_STATES | STARTED_STATES)
        .values_list("id", "team_id", "state")
    )
    back = [Move(j, t, s, reasons[j]) for j, t, s in victims if s in NOT_STARTED_STATES]
    stopping = [Move(j, t, s, reasons[j]) for j, t, s in victims if s in STARTED_STATES]
    jobs_move(moves=back, to=JobState.PENDING, by=None, now=now)
    waiting = "preempted; waiting for the next scheduling pass"
    _write_reasons([(m.job_id, waiting, None) for m in back])
    jobs_move(moves=stopping, to=JobState.PREEMPTING, by=None, now=now)
    applied.preempted.extend(job_id for job_id, _, _ in victims)


def _apply_bursts(
    bursts: list[plain.BurstRequest], *, now, applied: Applied, waits: dict[int, plain.Wait]
) -> None:
    """Ask the fleet for cloud nodes for jobs still waiting whose budget allows what the
    burst will cost; the fleet asks once per job (apps/fleet/cloud.py). A burst the
    budget refuses says why in the job's waiting reason (`waits`, written after this).
    In a savepoint: a failed burst must not undo the pass's placements."""
    if not bursts:
        return
    from apps.jobs.services import budget_allows

    placed = set(applied.placed)
    jobs = {
        row[0]: row
        for row in Job.objects.select_for_update()
        .filter(pk__in=[b.job_id for b in bursts], state=JobState.PENDING)
        .values_list("id", "team_id", "gpus_per_node", "time_limit_s", "max_cost_usd")
    }
    wanted = []
    for burst in bursts:
        row = jobs.get(burst.job_id)
        if row is None or burst.job_id in placed:
            continue
        _, team_id, per_node, limit, max_cost = row
        wanted.append(
            BurstCost(
                job_id=burst.job_id,
                team_id=team_id,
                pool_id=burst.pool_id,
                spot=burst.spot,
                nodes=burst.nodes,
                gpus_per_node=per_node,
                time_limit_s=limit,
                max_cost=max_cost,
            )
        )
    verdicts = budget_allows(bursts=wanted)
    asks = []
    for burst in wanted:
        verdict = verdicts[burst.job_id]
        if not verdict.allowed:
            log.info("job %d: %s", burst.job_id, verdict.reason)
            waits[burst.job_id] = plain.Wait(reason=verdict.reason)
            continue
        asks.append(
            cloud.BurstAsk(
                job_id=burst.job_id,
                pool_id=burst.pool_id,
                nodes=burst.nodes,
                gpus_per_node=burst.gpus_per_node,
                spot=burst.spot,
            )
        )
    try:
        with transaction.atomic():
            applied.burst_nodes = cloud.burst_nodes_request(asks=asks, now=now).node_ids
    except Exception:
        log.exception("burst requests failed; the next pass asks again")


_NOT_PENDING = object()  # a job the read did not find pending: the pass keeps no reason for it


def _apply_reasons(waits: dict[int, plain.Wait], ctx: ReadContext, applied: Applied) -> None:
    """Write only the reasons that changed since the last pass: first reasons with COPY,
    changed ones with one upsert. Only the pass (under its lock) adds wait rows, so a
    job read without one still has none here.

    Jobs past the backfill depth (plain.BEYOND, most of a long queue) keep no row: a
    pending job without one reads as that reason once a pass has read it
    (Job.pending_reason). A job that falls past the depth loses the row it had."""
    placed = set(applied.placed)
    stored = ctx.reasons
    first: list[tuple[int, str, dt.datetime | None]] = []
    changed: list[tuple[int, str, dt.datetime | None]] = []
    beyond = plain.BEYOND
    # Most of the queue is past the depth: of those jobs only the ones with a row need
    # anything (its removal), so the loop below walks the examined jobs alone.
    unexamined = [
        job_id
        for job_id, old in stored.items()
        if old is not None and waits.get(job_id) is beyond and job_id not in placed
    ]
    examined = [(job_id, wait) for job_id, wait in waits.items() if wait is not beyond]
    # Many jobs share one Wait (one per wording): its stored form is worked out once.
    forms: dict[int, tuple[str, float | None, dt.datetime | None]] = {}
    for job_id, wait in examined:
        if job_id in placed:
            continue
        old = stored.get(job_id, _NOT_PENDING)
        if old is _NOT_PENDING:
            continue
        form = forms.get(id(wait))
        if form is None:
            # Stored to the minute, so a start that moves by seconds is not a change.
            start = None if wait.estimated_start is None else wait.estimated_start // 60 * 60
            estimated = None if start is None else dt.datetime.fromtimestamp(start, tz=dt.UTC)
            form = forms[id(wait)] = (wait.reason[:300], start, estimated)
        reason, start, estimated = form
        if old is None:
            first.append((job_id, reason, estimated))
            continue
        old_reason, old_start = old
        if reason != old_reason or start != (None if old_start is None else round(old_start)):
            changed.append((job_id, reason, estimated))
    insert_rows(JobWait, ("job", "reason", "estimated_start"), first)
    _write_reasons(changed)
    if unexamined:
        JobWait.objects.filter(InArray("job_id", unexamined)).delete()
    applied.reasons_written = len(first) + len(changed) + len(unexamined)


def _write_reasons(rows: list[tuple[int, str, dt.datetime | None]]) -> None:
    """Upsert (job, reason, estimated start) rows into JobWait."""
    if not rows:
        return
    if connection.vendor == "postgresql":
        # One INSERT from three arrays: three parameters, however many rows.
        ids, reasons, starts = (list(column) for column in zip(*rows, strict=True))
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {JobWait._meta.db_table} AS w (job_id, reason, estimated_start) "  # noqa: S608
                "SELECT * FROM unnest(%s::bigint[], %s::varchar[], %s::timestamptz[]) "
                "ON CONFLICT (job_id) DO UPDATE "
                "SET reason = EXCLUDED.reason, estimated_start = EXCLUDED.estimated_start",
                [int_array(ids), reasons, starts],
            )
        return
    JobWait.objects.bulk_create(
        [JobWait(job_id=j, reason=r, estimated_start=e) for j, r, e in rows],
        update_conflicts=True,
        unique_fields=["job"],
        update_fields=["reason", "estimated_start"],
        batch_size=300,
    )


def _advance_usage(ctx: ReadContext) -> None:
    """Add what each team held since the last pass (scaled; decay needs no write)."""
    now = ctx.now
    # With the cache down this pass adds nothing and leaves the key as it was: the first
    # pass once it is back adds the whole time since the last one that could write it.
    last = best_effort.get(LAST_PASS_KEY)
    # Once committed: a pass rolled back added no usage, and its reasons are not there to
    # be read (Job.pending_reason reads this key too).
    transaction.on_commit(lambda: best_effort.set(LAST_PASS_KEY, now.timestamp(), timeout=None))
    if last is None:
        return  # the first pass (or the cache was lost or is down): nothing to add yet
    elapsed = max(now.timestamp() - last, 0.0)
    scale = decay_scale(now)
    rows = [
        (team_id, held * elapsed * scale, now)
        for team_id, held in ctx.held_by_team.items()
        if held and elapsed
    ]
    if not rows:
        return
    table = TeamUsage._meta.db_table
    add = (
        "ON CONFLICT (team_id) DO UPDATE SET "
        f"scaled_gpu_seconds = {table}.scaled_gpu_seconds + excluded.scaled_gpu_seconds, "
        "updated_at = excluded.updated_at"
    )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One statement from two arrays: a thousand teams' upserts one by one cost a
            # tenth of a steady pass.
            teams, added = [row[0] for row in rows], [row[1] for row in rows]
            cursor.execute(
                f"INSERT INTO {table} (team_id, scaled_gpu_seconds, updated_at) "  # noqa: S608
                f"SELECT t, s, %s FROM unnest(%s::bigint[], %s::float8[]) AS v(t, s) {add}",
                [now, int_array(teams), added],
            )
            return
        cursor.executemany(
            f"INSERT INTO {table} (team_id, scaled_gpu_seconds, updated_at) "  # noqa: S608
            f"VALUES (%s, %s, %s) {add}",
            rows,
        )


@transaction.atomic
def decisions_apply(decisions: plain.Decisions, ctx: ReadContext) -> Applied:
    """Write one pass's decisions: placements first, then preemptions, bursts and reasons."""
    now = ctx.now or timezone.now()
    applied = Applied()
    _apply_placements(decisions.placements, now=now, reasons=ctx.reasons, applied=applied)
    _apply_preemptions(decisions.preemptions, now=now, applied=applied)
    _apply_bursts(decisions.bursts, now=now, applied=applied, waits=decisions.waits)
    _apply_reasons(decisions.waits, ctx, applied)
    _advance_usage(ctx)
    if applied.placed:
        _dispatch_soon(list(applied.placed))
    return applied


DISPATCH_BATCH = 200  # job ids one dispatch message carries


def _dispatch_soon(job_ids: list[int], batch: int = DISPATCH_BATCH) -> None:
    """Once the pass commits, hand the placed jobs to dispatch in one message: up to
    `batch` ids straight to `jobs.dispatch`, more to `jobs.dispatch_many`, which splits
    them into batches for the workers (dispatch_batches_send), so a pass that placed
    thousands of jobs waits for one message to the broker, not twenty."""
    task = "jobs.dispatch" if len(job_ids) <= batch else "jobs.dispatch_many"
    enqueue_on_commit(
        task, job_ids, covered_by="the re-dispatch sweep", argsrepr=_ids_repr(job_ids)
    )


def dispatch_batches_send(job_ids: list[int], batch: int = DISPATCH_BATCH) -> int:
    """`jobs.dispatch` messages for these ids, `batch` ids each (several workers then
    dispatch them at once), over one broker connection. Returns the messages sent."""
    from controlplane.celery import app

    sent = 0
    with app.producer_or_acquire() as producer:
        for start in range(0, len(job_ids), batch):
            ids = job_ids[start : start + batch]
            app.send_task("jobs.dispatch", args=[ids], producer=producer, argsrepr=_ids_repr(ids))
            sent += 1
    return sent


def _ids_repr(job_ids: list[int]) -> str:
    # Short: Celery would otherwise format every id into the message's headers.
    return f"[{len(job_ids)} job ids from {job_ids[0]}]"
