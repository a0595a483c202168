"""The one road every job state change takes, and what comes with it: runs asked to stop,
GPUs released once their processes are gone, webhook calls owed, a scheduling pass asked
for. Submits and operators' actions (services) and what agents report (dispatch) both go
this way."""

import datetime as dt
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.services import audit_record_many
from apps.fleet import services as fleet
from apps.jobs.models import (
    OPEN_RUN_STATES,
    Allocation,
    Job,
    JobEvent,
    JobState,
    JobWait,
    Run,
    RunState,
    Webhook,
)
from apps.jobs.models.jobs import FINISHED_STATES, HOLDING_STATES
from apps.outbox import services as outbox
from apps.tuning.runs import tuning_runs_follow_jobs
from controlplane.bulk import InArray, update_logged
from controlplane.cache import best_effort
from controlplane.celery import app
from controlplane.errors import ApplicationError

log = logging.getLogger(__name__)
J = JobState
R = RunState

JOB_TRANSITIONS: dict[str, set[str]] = {
    J.PENDING: {J.HELD, J.ADMITTED, J.CANCELLED},
    J.HELD: {J.PENDING, J.CANCELLED},
    J.ADMITTED: {J.PROVISIONING, J.PENDING, J.CANCELLED, J.FAILED},
    J.PROVISIONING: {J.STARTING, J.PENDING, J.STOPPING, J.FAILED},
    J.STARTING: {J.RUNNING, J.PENDING, J.PREEMPTING, J.STOPPING, J.FAILED},
    J.RUNNING: {J.SUCCEEDED, J.FAILED, J.PREEMPTING, J.STOPPING, J.PENDING},
    J.PREEMPTING: {J.PENDING, J.FAILED},
    J.STOPPING: {J.CANCELLED, J.FAILED},
    J.SUCCEEDED: set(),
    J.FAILED: {J.PENDING},
    J.CANCELLED: {J.PENDING},
}


# The job states a tuning run follows; admissions (a first pass's thousands) are not among them.
TUNING_FOLLOWS = {J.RUNNING, J.PENDING, J.SUCCEEDED, J.FAILED, J.CANCELLED}


def actor_label(by) -> str:
    """Who a change is written down as: the user, or the scheduler when nobody asked."""
    return by.get_username() if by is not None else "scheduler"


_asked_at = [float("-inf")]  # when this process last asked for a pass (monotonic seconds)


def schedule_soon() -> None:
    """Ask for a scheduling pass after this transaction commits, coalescing bursts.

    A thousand submits inside the coalescing window send one task, not a thousand:
    the shared cache coalesces across processes, and each process skips even the
    cache while its own request is still pending (the beat covers any gap).
    """

    def send():
        now = time.monotonic()
        if now - _asked_at[0] < settings.SCHEDULE_COALESCE_S / 2:
            return
        _asked_at[0] = now
        if best_effort.add("jobs:schedule:queued", 1, timeout=settings.SCHEDULE_COALESCE_S):
            try:
                app.send_task("jobs.schedule", countdown=settings.SCHEDULE_COALESCE_S)
            except Exception:  # the beat runs the pass anyway; a submit must not fail
                log.warning("could not enqueue a scheduling pass", exc_info=True)

    transaction.on_commit(send)


@dataclass(frozen=True)
class Move:
    """One job's step in a state change: its id, its team, the state it leaves, and why."""

    job_id: int
    team_id: int
    came_from: str
    reason: str


def jobs_move(*, moves: list[Move], to: str, by, now: dt.datetime, **fields) -> None:
    """The one road every job state change takes: for one job (job_transition) and for
    the scheduler's thousands (placements, preemptions) alike.

    The jobs are locked by the caller and each is allowed to go to `to`. Writes the
    state, one JobEvent per job, the audit rows, and the change's side effects: runs
    asked to stop, GPUs released (once each run there has ended), waiting reasons
    dropped, webhooks owed, a scheduling pass asked for. Admissions (the scheduler's
    placements) are recorded by their JobEvents alone, without audit rows: a first pass
    admits thousands; the audit log keeps what takes something from someone.
    """
    if not moves:
        return
    values = {
        "state": to,
        "state_changed_at": now,
        "finished_at": now if to in FINISHED_STATES else None,
        **fields,
    }
    if to == J.PENDING:
        values["pool"] = None
    actor_id = by.pk if by is not None and by.pk else None
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for move in moves:
        groups[(move.came_from, move.reason[:300])].append(move.job_id)
    for (came_from, reason), job_ids in groups.items():
        # The state and its JobEvents in one statement on PostgreSQL (update_logged).
        update_logged(
            Job.objects.filter(InArray("id", job_ids)),
            {**values, "state_reason": reason},
            log=JobEvent,
            log_fields=("job", "at", "from_state", "to_state", "reason", "actor", "actor_label"),
            log_values=(now, came_from, to, reason, actor_id, actor_label(by)),
        )
    ids = [move.job_id for move in moves]
    waiting = [m.job_id for m in moves if to == J.PENDING or m.came_from == J.PENDING]
    if waiting:
        JobWait.objects.filter(InArray("job_id", waiting)).delete()  # an old wait says nothing now
    if not (to == J.ADMITTED and by is None):
        _audit_moves(moves, to=to, by=by, fields=fields)
    leaving = (
        [m.job_id for m in moves if m.came_from in HOLDING_STATES]
        if to not in HOLDING_STATES
        else []
    )
    stopping = ids if to in (J.STOPPING, J.PREEMPTING) else leaving
    if stopping:
        runs_stop_for(job_ids=stopping, reasons={m.job_id: m.reason for m in moves})
    if leaving:
        allocations_release(job_ids=leaving, now=now)
    if to in FINISHED_STATES:
        _owe_webhook_calls(ids, now=now)
    if to in TUNING_FOLLOWS:
        # A tuning run follows its job (apps/tuning/runs.py): one look-up by job id.
        tuning_runs_follow_jobs(job_ids=ids, to=to, reason=moves[0].reason)
    if to in (J.PENDING, J.CANCELLED, J.FAILED, J.SUCCEEDED):
        schedule_soon()


def job_note(*, job_id: int, reason: str, by=None) -> JobEvent | None:
    """A JobEvent that changes nothing (from and to the job's current state): what a
    reader of the job's timeline must know between its state changes, such as the
    checkpoint an attempt resumed from or the rank that really failed. None if the job
    is gone."""
    state = Job.objects.filter(pk=job_id).values_list("state", flat=True).first()
    if state is None:
        return None
    return JobEvent.objects.create(
        job_id=job_id,
        from_state=state,
        to_state=state,
        reason=reason[:300],
        actor=by if by is not None and by.pk else None,
        actor_label=actor_label(by),
    )


def _audit_moves(moves: list[Move], *, to: str, by, fields: dict) -> None:
    plain = {k: v for k, v in fields.items() if isinstance(v, int | str | bool | type(None))}
    jobs = Job.objects.only("id", "name").in_bulk([m.job_id for m in moves])
    by_team: dict[int, list] = defaultdict(list)
    for move in moves:
        by_team[move.team_id].append(
            (
                jobs[move.job_id],
                {"state": move.came_from},
                {"state": to, "state_reason": move.reason[:300], **plain},
            )
        )
    for team_id, changes in by_team.items():
        audit_record_many(actor=by, action=f"job.{to}", changes=changes, team_id=team_id)


def moves_allowed(rows, *, to: str) -> tuple[list[Move], list[tuple[int, str]]]:
    """Split locked (job id, team id, state, reason) rows into the moves `to` allows and the
    (job id, state) of those it does not."""
    allowed, refused = [], []
    for job_id, team_id, state, reason in rows:
        if to in JOB_TRANSITIONS[state]:
            allowed.append(Move(job_id, team_id, state, reason))
        else:
            refused.append((job_id, state))
    return allowed, refused


@transaction.atomic
def job_transition(*, job: Job, to: str, reason: str, by, **fields) -> Job:
    """Move one job to `to` (jobs_move), or answer 409 if its state does not allow it."""
    state, team_id = (
        Job.objects.select_for_update().filter(pk=job.pk).values_list("state", "team_id").get()
    )
    moves, refused = moves_allowed([(job.pk, team_id, state, reason)], to=to)
    if refused:
        raise ApplicationError(
            f"Job {job.pk} is {state}; it cannot go to {to}.",
            code="invalid_transition",
            details={"state": [f"{state} → {to} is not allowed."]},
            status=409,
        )
    jobs_move(moves=moves, to=to, by=by, now=timezone.now(), **fields)
    return Job.objects.get(pk=job.pk)


def allocations_release(*, job_ids: list[int], now: dt.datetime) -> None:
    """The jobs no longer want their GPUs. An allocation with no run of it still open ends
    now; one whose run is still there ends when that run does (allocations_runs_ended),
    so its GPUs are never handed to another job while its processes live. Nodes left
    without work become READY (or DRAINED)."""
    open_ids = list(
        Allocation.objects.filter(InArray("job_id", job_ids), ended_at__isnull=True).values_list(
            "id", flat=True
        )
    )
    if not open_ids:
        return
    busy = _with_open_runs(open_ids)
    if busy:
        Allocation.objects.filter(InArray("id", sorted(busy))).update(release_wanted=True)
    _allocations_end([a for a in open_ids if a not in busy], now=now)


def allocations_runs_ended(*, allocation_ids, now: dt.datetime) -> None:
    """Runs on these allocations ended: end the ones their jobs let go of with no run left."""
    wanted = list(
        Allocation.objects.filter(
            InArray("id", sorted(set(allocation_ids) - {None})),
            ended_at__isnull=True,
            release_wanted=True,
        ).values_list("id", flat=True)
    )
    if not wanted:
        return
    busy = _with_open_runs(wanted)
    _allocations_end([a for a in wanted if a not in busy], now=now)


def _with_open_runs(allocation_ids: list[int]) -> set[int]:
    """Those of the allocations a run of which may still have a process."""
    return set(
        Run.objects.filter(
            InArray("allocation_id", allocation_ids), state__in=OPEN_RUN_STATES
        ).values_list("allocation_id", flat=True)
    )


def _allocations_end(allocation_ids: list[int], *, now: dt.datetime) -> None:
    if not allocation_ids:
        return
    node_ids = list(
        Allocation.objects.filter(InArray("id", allocation_ids))
        .values_list("node_id", flat=True)
        .distinct()
    )
    Allocation.objects.filter(InArray("id", allocation_ids)).update(ended_at=now)
    still_busy = set(
        Allocation.objects.filter(InArray("node_id", node_ids), ended_at__isnull=True).values_list(
            "node_id", flat=True
        )
    )
    fleet.nodes_work_ended(node_ids=node_ids, still_busy=still_busy)
    schedule_soon()  # GPUs came free


def _owe_webhook_calls(job_ids: list[int], *, now: dt.datetime) -> None:
    jobs = list(Job.objects.select_related("team").filter(InArray("id", job_ids)))
    hooks = list(Webhook.objects.filter(team_id__in={j.team_id for j in jobs}, active=True))
    calls = []
    for job in jobs:
        payload = {
            "job": job.pk,
            "uuid": str(job.uuid),
            "name": job.name,
            "team": job.team.slug,
            "state": job.state,
            "reason": job.state_reason,
            "finished_at": now.isoformat(),
        }
        calls += [
            outbox.Call(
                team_id=job.team_id,
                topic="job.finished",
                source=webhook_source(hook.pk),
                url=hook.url,
                signing_key=hook.signing_key,
                payload=payload,
            )
            for hook in hooks
            if hook.team_id == job.team_id and hook.job_id in (None, job.pk)
        ]
    outbox.calls_owe(calls, now=now)


def webhook_source(webhook_id: int) -> str:
    """The outbox's name for a job webhook: its calls are dropped when it is removed."""
    return f"webhook:{webhook_id}"


def runs_stop_for(*, job_ids: list[int], reasons: dict[int, str]) -> int:
    """Ask the agents to stop the jobs' open runs (they see it on their next poll); runs
    never started are dropped. Returns the runs asked to stop. Called by every job state
    change that stops or leaves its GPUs (jobs_move)."""
    now = timezone.now()
    by_reason: dict[str, list[int]] = {}
    for job_id in job_ids:
        by_reason.setdefault(reasons.get(job_id, "")[:300], []).append(job_id)
    asked, dropped = 0, []
    for reason, ids in by_reason.items():
        planned = Run.objects.filter(job_id__in=ids, state=R.PLANNED)
        dropped += planned.values_list("allocation_id", flat=True)
        planned.update(state=R.LOST, reason=reason, ended_at=now)
        asked += Run.objects.filter(
            job_id__in=ids, state=R.RUNNING, stop_requested_at__isnull=True
        ).update(stop_requested_at=now, stop_reason=reason)
    allocations_runs_ended(allocation_ids=dropped, now=now)
    return asked
