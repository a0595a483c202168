"""Periodic fleet upkeep."""

import logging

from celery import shared_task

from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)


@shared_task(name="fleet.heartbeat_sweep", acks_late=True, reject_on_worker_lost=True)
def heartbeat_sweep() -> dict:
    """Mark nodes SUSPECT (then DOWN) when their heartbeats stop."""
    from apps.accounts.context import Origin, acting_from
    from apps.fleet.services import nodes_heartbeat_sweep

    with single_flight("fleet.heartbeat_sweep", ttl_s=120) as got_it:
        if not got_it:
            return {"skipped": "another sweep is running"}
        with acting_from(Origin(channel="task", label="task:fleet.heartbeat_sweep")):
            counts = nodes_heartbeat_sweep()
    if counts["suspect"] or counts["down"]:
        log.info("heartbeat sweep: %(suspect)d suspect, %(down)d down", counts)
    return counts
