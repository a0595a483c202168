"""Periodic fleet upkeep."""

import logging

from celery import shared_task

from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)


@shared_task(name="fleet.heartbeat_sweep", acks_late=True, reject_on_worker_lost=True)
def heartbeat_sweep() -> dict:
    """Write the heartbeats that landed in the cache, then mark silent nodes SUSPECT (then DOWN)."""
    from apps.accounts.context import Origin, acting_from
    from apps.fleet.agents import nodes_heartbeats_flush
    from apps.fleet.services import nodes_heartbeat_sweep

    with single_flight("fleet.heartbeat_sweep", ttl_s=120) as got_it:
        if not got_it:
            return {"skipped": "another sweep is running"}
        with acting_from(Origin(channel="task", label="task:fleet.heartbeat_sweep")):
            down_allowed = not _just_heard_again()
            counts = {
                **nodes_heartbeats_flush(),
                **nodes_heartbeat_sweep(down_allowed=down_allowed),
            }
            _swept()
            # What the agents hold is the truth about processes (jobs sit above fleet, so
            # the task joins the two here as well).
            from apps.jobs.dispatch import runs_reconcile_with_agents

            counts["lost"] = len(runs_reconcile_with_agents())
            if counts["down"]:
                # Nodes lost for good: their jobs go back to the queue now, not at the
                # next reconcile (jobs sit above fleet, so the task joins the two).
                from apps.jobs.dispatch import jobs_on_down_nodes

                counts["requeued"] = len(jobs_on_down_nodes())
    if any(counts[name] for name in ("suspect", "down", "resumed", "drained", "back", "lost")):
        log.info(
            "heartbeats: %(written)d written, %(resumed)d resumed, %(back)d back from down, "
            "%(drained)d drained; %(suspect)d suspect, %(down)d down; %(lost)d run(s) lost",
            counts,
        )
    return counts


SWEPT_KEY = "fleet:heartbeat_sweep:ok_at"
DEAF_KEY = "fleet:heartbeat_sweep:deaf_until"


def _just_heard_again() -> bool:
    """Whether the control plane has just come back from a time it could not sweep (its
    database or workers down): then agents whose heartbeats it could not take are not
    marked DOWN until they have had NODE_SUSPECT_AFTER_S to be heard again. Without the
    cache, sweep as usual."""
    import time

    from django.conf import settings

    from controlplane.cache import best_effort

    now = time.time()
    last, deaf_until = best_effort.get(SWEPT_KEY), best_effort.get(DEAF_KEY)
    if last and now - last > 3 * settings.NODE_SWEEP_EVERY_S:
        deaf_until = now + settings.NODE_SUSPECT_AFTER_S
        best_effort.set(DEAF_KEY, deaf_until, timeout=settings.NODE_DOWN_AFTER_S)
        log.warning("heartbeat sweep: none for %.0f s; no node goes DOWN for a while", now - last)
    return bool(deaf_until) and now < deaf_until


def _swept() -> None:
    import time

    from django.conf import settings

    from controlplane.cache import best_effort

    best_effort.set(SWEPT_KEY, time.time(), timeout=settings.NODE_DOWN_AFTER_S * 10)


@shared_task(name="fleet.telemetry_rollup", acks_late=True, reject_on_worker_lost=True)
def telemetry_rollup() -> dict:
    """Average the GPU samples of finished minutes, and delete telemetry past retention."""
    from apps.fleet.telemetry import gpu_telemetry_rollup

    with single_flight("fleet.telemetry_rollup", ttl_s=300) as got_it:
        if not got_it:
            return {"skipped": "another rollup is running"}
        return gpu_telemetry_rollup()
