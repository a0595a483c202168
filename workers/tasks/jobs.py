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
    """Requeue or cancel jobs stuck preempting or stopping past the grace period."""
    from apps.accounts.context import Origin, acting_from
    from apps.jobs.services import jobs_reconcile

    with single_flight("jobs.reconcile", ttl_s=300) as got_it:
        if not got_it:
            return {"skipped": "another reconcile is running"}
        with acting_from(Origin(channel="task", label="task:jobs.reconcile")):
            return jobs_reconcile()


@shared_task(name="jobs.deliver_webhooks", acks_late=True, reject_on_worker_lost=True)
def deliver_webhooks() -> dict:
    """Send the webhook calls that are due (finished jobs), with retries and backoff."""
    from apps.jobs.services import webhook_deliveries_send

    return webhook_deliveries_send()
