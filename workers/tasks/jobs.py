"""The scheduling pass, on a beat and soon after submits, finishes and cancels."""

import dataclasses
import logging

from celery import shared_task
from django.core.cache import cache

from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)


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
                **jobs_stuck_redrive(),
                "lost": len(jobs_on_down_nodes()),
            }


@shared_task(name="jobs.dispatch", acks_late=True, reject_on_worker_lost=True)
def dispatch(job_ids: list[int]) -> dict:
    """Write the run plans of newly placed jobs; their nodes' agents start them."""
    from apps.accounts.context import Origin, acting_from
    from apps.jobs.dispatch import job_dispatch

    dispatched = 0
    with acting_from(Origin(channel="task", label="task:jobs.dispatch")):
        for job_id in job_ids:
            try:
                dispatched += job_dispatch(job_id=job_id) is not None
            except Exception:  # one job's failure must not hold up the others
                log.exception("dispatch of job %s failed; the reconcile sweep retries it", job_id)
    return {"dispatched": dispatched}


@shared_task(name="jobs.purge_logs", acks_late=True)
def purge_logs() -> dict:
    """Delete job output older than LOG_RETENTION_DAYS."""
    from apps.jobs.dispatch import log_lines_delete_old

    return {"deleted": log_lines_delete_old()}


@shared_task(name="jobs.deliver_webhooks", acks_late=True, reject_on_worker_lost=True)
def deliver_webhooks() -> dict:
    """Send the webhook calls that are due (finished jobs), with retries and backoff."""
    from apps.jobs.services import webhook_deliveries_send

    return webhook_deliveries_send()
