"""The periodic sweeps of cloud nodes on AWS.

fleet.cloud_sweep    overdue boots FAILED, lost provisioning re-driven, idle and
                     failed nodes terminated, empty placement groups deleted
fleet.orphan_sweep   instances with our tag that no node knows: reported or terminated
"""

import datetime as dt
import logging

from celery import shared_task
from django.conf import settings
from django.core.cache import cache
from django.utils import timezone

from workers.providers import errors
from workers.providers.aws import TAG_POOL, AwsProvider
from workers.tasks.aws_nodes import aws_config
from workers.tasks.locks import single_flight
from workers.tasks.provisioning import terminate_node

log = logging.getLogger(__name__)

# How long after its last node ended a placement group is still worth deleting.
PLACEMENT_GROUP_CLEANUP_S = 3600


# --- the cloud sweep -----------------------------------------------------------------------------


def cloud_sweep_run(*, now: dt.datetime | None = None) -> dict[str, int]:
    """One pass over the cloud nodes (the `fleet.cloud_sweep` task, on a beat)."""
    from apps.fleet import cloud
    from controlplane.celery import app

    now = now or timezone.now()
    counts = {"failed": cloud.cloud_nodes_fail_overdue(now=now)}

    redriven = 0
    for node_id in cloud.cloud_nodes_stalled(now=now):
        # At most once per period per node, whatever the sweep's own rhythm.
        if cache.add(f"fleet:cloud-redrive:{node_id}", 1, timeout=settings.CLOUD_REDRIVE_AFTER_S):
            try:
                app.send_task("fleet.provision", args=[node_id])
                redriven += 1
            except Exception:
                log.warning("could not re-drive provisioning of node %s", node_id, exc_info=True)
    counts["redriven"] = redriven

    counts["retired"] = sum(
        cloud.cloud_node_retire(node_id=node_id, now=now)
        for node_id in cloud.cloud_nodes_to_retire(now=now)
    )
    terminated = 0
    for node_id in cloud.cloud_nodes_terminating():
        try:
            terminated += terminate_node(node_id) == "terminated"
        except Exception:  # one node's failure must not hold up the others; retried next sweep
            log.exception("terminating node %s failed; the next cloud sweep tries again", node_id)
    counts["terminated"] = terminated

    deleted = 0
    since = now - dt.timedelta(seconds=PLACEMENT_GROUP_CLEANUP_S)
    for region, group in cloud.placement_groups_released(since=since):
        key = f"fleet:placement-group-deleted:{group}"
        if cache.get(key):
            continue
        try:
            if AwsProvider(aws_config(region)).placement_group_delete(group):
                cache.set(key, 1, timeout=2 * PLACEMENT_GROUP_CLEANUP_S)
                deleted += 1
        except errors.ProviderError as exc:
            log.warning("deleting placement group %s: %s", group, exc)
    counts["placement_groups_deleted"] = deleted
    return counts


@shared_task(name="fleet.cloud_sweep", acks_late=True, reject_on_worker_lost=True)
def cloud_sweep() -> dict:
    from apps.accounts.context import Origin, acting_from

    with single_flight("fleet.cloud_sweep", ttl_s=900) as got_it:
        if not got_it:
            return {"skipped": "another cloud sweep is running"}
        with acting_from(Origin(channel="task", label="task:fleet.cloud_sweep")):
            counts = cloud_sweep_run()
    if any(counts.values()):
        log.info("cloud sweep: %s", counts)
    return counts


# --- the orphan sweep ----------------------------------------------------------------------------


def orphan_sweep_run(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Find live instances with our CONTROLPLANE_ID tag whose node the database does not
    know, in every region we use; terminate those whose pool says so, report the rest."""
    from apps.fleet import cloud

    now = now or timezone.now()
    totals = {"reported": 0, "terminated": 0, "new": 0, "gone": 0, "regions_failed": 0}
    for region in cloud.cloud_regions():
        provider = AwsProvider(aws_config(region))
        try:
            candidates = provider.orphan_sweep(cloud.node_uuids_known(), terminate=False)
            # A node requested while the instances were listed was committed before its
            # launch: asking again about just these tells it from a real orphan.
            known = cloud.node_uuids_known(among=[c.node_uuid for c in candidates if c.node_uuid])
            orphans = [c for c in candidates if c.node_uuid.lower() not in known]
            policies = cloud.orphan_policies(pool_slugs=[c.tags.get(TAG_POOL, "") for c in orphans])
            doomed = {
                c.instance_id
                for c in orphans
                if cloud.orphan_should_terminate(
                    pool_tag=c.tags.get(TAG_POOL, ""), policies=policies
                )
            }
            if doomed:
                provider.instances_terminate(sorted(doomed))
        except errors.ProviderError as exc:
            # No credentials on a laptop, or AWS unreachable: say so, try the other regions.
            log.warning("orphan sweep in %s: %s", region, exc)
            totals["regions_failed"] += 1
            continue
        counts = cloud.orphan_instances_record(
            region=region,
            found=[
                cloud.OrphanSeen(
                    instance_id=c.instance_id,
                    node_uuid=c.node_uuid,
                    pool_tag=c.tags.get(TAG_POOL, ""),
                    instance_type=c.instance_type,
                    state=c.state,
                    launched_at=c.launch_time,
                    terminated=c.instance_id in doomed,
                )
                for c in orphans
            ],
            now=now,
        )
        for name in ("reported", "terminated", "new", "gone"):
            totals[name] += counts[name]
    return totals


@shared_task(name="fleet.orphan_sweep", acks_late=True, reject_on_worker_lost=True)
def orphan_sweep() -> dict:
    from apps.accounts.context import Origin, acting_from

    with single_flight("fleet.orphan_sweep", ttl_s=900) as got_it:
        if not got_it:
            return {"skipped": "another orphan sweep is running"}
        with acting_from(Origin(channel="task", label="task:fleet.orphan_sweep")):
            counts = orphan_sweep_run()
    if counts["reported"] or counts["terminated"]:
        log.warning("orphan sweep: %s", counts)
    return counts
