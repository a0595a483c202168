"""Cloud nodes on AWS: the provider bound to node rows, and the periodic cloud sweeps.

`aws_provider_for(node)` is what provisioning.provider_for answers for an aws node:
the AWS provider wrapped so that a launch records its instance on the node, and the
node's agent token stays the one its user data carries. The sweeps:

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
from workers.providers.aws import (
    TAG_POOL,
    AwsConfig,
    AwsNodeSpec,
    AwsProvider,
    CapacityPreference,
)
from workers.providers.bundle import Bundle
from workers.providers.interface import BootstrapReport, NodeDescription, Progress
from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)

# How long after its last node ended a placement group is still worth deleting.
PLACEMENT_GROUP_CLEANUP_S = 3600


def aws_config(region: str = "") -> AwsConfig:
    return AwsConfig(
        control_plane_id=settings.CONTROLPLANE_ID,
        control_plane_url=settings.CONTROLPLANE_URL,
        region=region or settings.AWS_REGION,
        endpoint_url=settings.AWS_ENDPOINT_URL or None,
        agent_bundle_url=settings.AGENT_BUNDLE_URL,
    )


class AwsNodeProvider:
    """The AWS provider for one node row, with the bookkeeping the fleet needs."""

    kind = "aws"

    def __init__(self, provider: AwsProvider, node_id: int):
        self.provider = provider
        self.node_id = node_id

    def _node(self):
        from apps.fleet.models import Node

        return Node.objects.get(pk=self.node_id)

    def _record(self, description: NodeDescription) -> None:
        from apps.fleet.cloud import cloud_node_launched

        if description.instance_id:
            cloud_node_launched(
                node_id=self.node_id,
                instance_id=description.instance_id,
                capacity_type=str(description.capacity_type or "") or None,
                launched_at=description.launch_time,
                address=description.address,
            )

    def create(self, spec: AwsNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        # Two workers on one node (a re-drive beside a retry) launch one at a time; the
        # look-up by tag and the ClientToken keep it to one instance either way.
        with single_flight(f"fleet.aws-launch:{spec.uuid}", ttl_s=300) as ours:
            if not ours:
                raise errors.ProvisioningFailed(
                    "Another worker is launching this node now.", retryable=True
                )
            description = self.provider.create(spec, progress=progress)
        self._record(description)
        return description

    def bootstrap(
        self,
        spec: AwsNodeSpec,
        bundle: Bundle | None = None,
        *,
        restart_agent: bool = False,
        progress: Progress | None = None,
    ) -> BootstrapReport:
        """Wait for the instance to run; its user data starts the agent, which registers
        with the user data's bootstrap token. (The bundle's token, which provisioning
        issues for every provider, never reaches an instance.)"""
        report = self.provider.bootstrap(spec, progress=progress)
        self._record(self.provider.describe(spec))
        return report

    def describe(self, spec: AwsNodeSpec) -> NodeDescription:
        return self.provider.describe(spec)

    def terminate(self, spec: AwsNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        return self.provider.terminate(spec, progress=progress)


def aws_provider_for(node) -> tuple[AwsNodeProvider, AwsNodeSpec]:
    """(provider, spec) for an aws node row: its pool's launch settings, its job's tags,
    spot unless the job, the pool or the pool's interruption rate says on-demand."""
    from apps.fleet import agents
    from apps.fleet.models import Node

    node = Node.objects.select_related("pool", "instance_type", "burst_job__team").get(pk=node.pk)
    pool = node.pool
    if node.instance_type is None:
        raise errors.ConfigurationError(f"Cloud node {node.name} has no instance type.")
    if not pool.image_id:
        raise errors.ConfigurationError(f"Cloud pool {pool.slug} has no image_id to launch.")
    spot = node.capacity_type == "spot" and pool.capacity_preference == "spot_then_on_demand"
    job = node.burst_job
    spec = AwsNodeSpec(
        uuid=str(node.uuid),
        name=node.name,
        instance_type=node.instance_type.name,
        image_id=pool.image_id,
        pool=pool.slug,
        team=job.team.slug if job is not None else "",
        job=str(job.pk) if job is not None else "",
        capacity=(
            CapacityPreference.SPOT_THEN_ON_DEMAND if spot else CapacityPreference.ON_DEMAND_ONLY
        ),
        spot_interruption_rate=agents.pool_spot_interruption_rate(pool_id=pool.pk),
        spot_interruption_threshold=pool.spot_interruption_limit,
        placement_group=node.placement_group,
        subnet_id=pool.subnet_id,
        security_group_ids=tuple(pool.security_group_ids or ()),
        key_name=pool.key_name,
        instance_profile=pool.instance_profile,
        node_token=agents.node_bootstrap_token(node=node),
    )
    return AwsNodeProvider(AwsProvider(aws_config(pool.region)), node.pk), spec


# --- the cloud sweep -----------------------------------------------------------------------------


def cloud_sweep_run(*, now: dt.datetime | None = None) -> dict[str, int]:
    """One pass over the cloud nodes (the `fleet.cloud_sweep` task, on a beat)."""
    from apps.fleet import cloud
    from controlplane.celery import app
    from workers.tasks.provisioning import terminate_node

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
