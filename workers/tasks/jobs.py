"""The scheduling pass, on a beat and soon after submits, finishes and cancels; dispatch of placed
jobs, which asks the checkpoint registry what a trainer job resumes from."""

import dataclasses
import logging

from celery import shared_task
from django.core.cache import cache

from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)
DISPATCH_RETRY_S = 2  # a job waiting on its checkpoints is dispatched again this soon


@shared_task(name="jobs.schedule", acks_late=True, reject_on_worker_lost=True)
def schedule() -> dict:
    """Run one pass under the scheduler lock; a pass already running makes this one a no-op."""
    from apps.accounts.context import Origin, acting_from
    from apps.jobs.scheduler.run import scheduling_pass

    # Triggers arriving from now on ask for another pass.
    cache.delete("jobs:schedule:queued")
    with single_flight("jobs.schedule", ttl_s=300) as got_it:
        if not got_it:
            return {"skipped": "another pass is running"}
        with acting_from(Origin(channel="task", label="task:jobs.schedule")):
            report = scheduling_pass()
    if report.placed or report.preempted:
        log.info("scheduling pass: %s", report)
    return dataclasses.asdict(report)


@shared_task(name="jobs.reconcile", acks_late=True, reject_on_worker_lost=True)
def reconcile() -> dict:
    """Re-drive jobs stuck in a transitional state: preempting or stopping past the grace
    period, admitted but never dispatched, started by no agent in time, past their time limit,
    or holding nodes that are lost."""
    from apps.accounts.context import Origin, acting_from
    from apps.jobs.dispatch import jobs_on_down_nodes, jobs_stuck_redrive
    from apps.jobs.services import jobs_reconcile

    with single_flight("jobs.reconcile", ttl_s=300) as got_it:
        if not got_it:
            return {"skipped": "another reconcile is running"}
        with acting_from(Origin(channel="task", label="task:jobs.reconcile")):
            return {
                **jobs_reconcile(),
                **jobs_stuck_redrive(dispatch=lambda job_id: dispatch_one(job_id) == "dispatched"),
                "lost": len(jobs_on_down_nodes()),
            }


@shared_task(name="jobs.redispatch", acks_late=True, reject_on_worker_lost=True)
def redispatch() -> dict:
    """Dispatch placed jobs whose dispatch was lost (apps/jobs/dispatch.jobs_admitted_redrive)."""
    from apps.accounts.context import Origin, acting_from
    from apps.jobs.dispatch import jobs_admitted_redrive

    with single_flight("jobs.redispatch", ttl_s=60) as got_it:
        if not got_it:
            return {"skipped": "another redispatch is running"}
        with acting_from(Origin(channel="task", label="task:jobs.redispatch")):
            done = jobs_admitted_redrive(
                dispatch=lambda job_id: dispatch_one(job_id) == "dispatched"
            )
            return {"dispatched": done}


def dispatch_one(job_id: int) -> str:
    """Dispatch one placed job: "dispatched", "waiting" (its new nodes are still listing its
    checkpoint directory or checking newer checkpoints: ask again soon) or "skipped".

    A trainer job resumes from the checkpoint the registry chooses (the newest verified one
    its new nodes reach) and copies its checkpoints where the registry says.
    """
    from apps.checkpoints.services import checkpoint_resume_prepare
    from apps.jobs.dispatch import job_dispatch

    plan = checkpoint_resume_prepare(job_id=job_id)
    if plan.wait:
        return "waiting"
    job = job_dispatch(job_id=job_id, resume_from=plan.resume_from, checkpoint_s3=plan.s3)
    if job is not None and plan.reason:
        log.info("job %s: resume %s", job_id, plan.reason)
    return "dispatched" if job is not None else "skipped"


@shared_task(name="jobs.dispatch", acks_late=True, reject_on_worker_lost=True)
def dispatch(job_ids: list[int]) -> dict:
    """Write the run plans of newly placed jobs; their nodes' agents start them."""
    from apps.accounts.context import Origin, acting_from

    counts = {"dispatched": 0, "waiting": 0}
    waiting = []
    with acting_from(Origin(channel="task", label="task:jobs.dispatch")):
        for job_id in job_ids:
            try:
                outcome = dispatch_one(job_id)
            except Exception:  # one job's failure must not hold up the others
                log.exception("dispatch of job %s failed; the reconcile sweep retries it", job_id)
                continue
            if outcome == "waiting":
                waiting.append(job_id)
            counts[outcome] = counts.get(outcome, 0) + 1
    if waiting:
        dispatch.apply_async(args=[waiting], countdown=DISPATCH_RETRY_S)
    return counts


@shared_task(name="jobs.dispatch_many", acks_late=True, reject_on_worker_lost=True)
def dispatch_many(job_ids: list[int]) -> int:
    """A pass's placed jobs, more than one dispatch message holds: split into `jobs.dispatch`
    batches. A worker lost before it acked sends them again; dispatching a job twice
    skips it the second time."""
    from apps.jobs.scheduler.apply import dispatch_batches_send

    return dispatch_batches_send(job_ids)


@shared_task(name="jobs.purge_logs", acks_late=True)
def purge_logs() -> dict:
    """Delete job output older than LOG_RETENTION_DAYS."""
    from apps.jobs.dispatch import log_lines_delete_old

    return {"deleted": log_lines_delete_old()}
