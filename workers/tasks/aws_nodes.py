"""The AWS provider bound to node rows: `aws_provider_for(node)` is what
provisioning.provider_for answers for an aws node, the AWS provider wrapped so that a
launch is one at a time, and the node's agent token stays the one its
user data carries."""

from django.conf import settings

from workers.providers import errors
from workers.providers.aws import AwsConfig, AwsNodeSpec, AwsProvider, CapacityPreference
from workers.providers.bundle import Bundle
from workers.providers.interface import BootstrapReport, NodeDescription, Progress
from workers.tasks.locks import single_flight


def aws_config(region: str = "") -> AwsConfig:
    return AwsConfig(
        control_plane_id=settings.CONTROLPLANE_ID,
        control_plane_url=settings.CONTROLPLANE_URL,
        region=region or settings.AWS_REGION,
        endpoint_url=settings.AWS_ENDPOINT_URL or None,
        agent_bundle_url=settings.AGENT_BUNDLE_URL,
    )


def launch_record(*, node_id: int, description: NodeDescription) -> None:
    """Write what a provider said it launched onto the node (owned nodes launch nothing)."""
    from apps.fleet.cloud import cloud_node_launched

    if description.instance_id:
        cloud_node_launched(
            node_id=node_id,
            instance_id=description.instance_id,
            capacity_type=str(description.capacity_type or "") or None,
            launched_at=description.launch_time,
            address=description.address,
        )


class AwsNodeProvider:
    """The AWS provider as provisioning calls every provider: one launch of a node at a
    time, and the agent started by the instance's user data. It answers plain data and
    writes no rows; provisioning records what it launched (launch_record)."""

    kind = "aws"

    def __init__(self, provider: AwsProvider):
        self.provider = provider

    def create(self, spec: AwsNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        # Two workers on one node (a re-drive beside a retry) launch one at a time; the
        # look-up by tag and the ClientToken keep it to one instance either way.
        with single_flight(f"fleet.aws-launch:{spec.uuid}", ttl_s=300) as ours:
            if not ours:
                raise errors.ProvisioningFailed(
                    "Another worker is launching this node now.", retryable=True
                )
            return self.provider.create(spec, progress=progress)

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
        return self.provider.bootstrap(spec, progress=progress)

    def describe(self, spec: AwsNodeSpec) -> NodeDescription:
        return self.provider.describe(spec)

    def terminate(self, spec: AwsNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        return self.provider.terminate(spec, progress=progress)


def aws_provider_for(node) -> tuple[AwsNodeProvider, AwsNodeSpec]:
    """(provider, spec) for an aws node row: its pool's launch settings, its job's tags,
    spot unless the job, the pool or the pool's interruption rate says on-demand."""
    from apps.fleet import agents
    from apps.fleet.selectors import node_for_launch

    node = node_for_launch(node_id=node.pk)
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
    return AwsNodeProvider(AwsProvider(aws_config(pool.region))), spec
