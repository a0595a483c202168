"""The `aws` provider: cloud nodes launched with boto3, spot first.

A node is at most one instance, whatever happens to the task that launches it:
before any launch the instance is looked up by our tags, and the launch itself
carries `ClientToken` = the node's UUID, so EC2 answers a repeated request with
the instance it already made (a token binds only when a launch succeeds, so the
on-demand fallback after a failed spot request reuses it). The instance installs
and starts the agent itself, from its user data.
"""

import contextlib
import dataclasses
import datetime as dt
import enum
import functools
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from urllib.parse import urlsplit

import boto3
import botocore.config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from workers.providers.bundle import (
    AGENT_ENV_FILE,
    AGENT_LOG_FILE,
    AGENT_PID_FILE,
    NODE_DIR_PREFIX,
    NODE_UUID_VARIABLE,
    Bundle,
    env_file_text,
)
from workers.providers.errors import (
    CapacityUnavailable,
    ConfigurationError,
    ProviderError,
    ProvisioningFailed,
)
from workers.providers.interface import (
    BootstrapReport,
    CapacityType,
    MachineState,
    NodeDescription,
    Progress,
    node_uuid,
    report,
)
from workers.providers.shell import quote_argv

logger = logging.getLogger(__name__)

TAG_CONTROL_PLANE = "controlplane:id"
TAG_NODE_UUID = "controlplane:node-uuid"
TAG_TEAM = "controlplane:team"
TAG_JOB = "controlplane:job"
TAG_POOL = "controlplane:pool"

# Instances in these states are a node's instance; shutting-down and terminated ones are not.
LIVE_STATES = ("pending", "running", "stopping", "stopped")
# A spot request failing with these falls back to on-demand.
SPOT_FALLBACK_CODES = frozenset({"InsufficientInstanceCapacity", "MaxSpotInstanceCountExceeded"})
_NO_CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientHostCapacity",
        "InsufficientCapacity",
        "MaxSpotInstanceCountExceeded",
        "SpotMaxPriceTooLow",
    }
)
_QUOTA_CODES = frozenset({"InstanceLimitExceeded", "VcpuLimitExceeded"})
_TRANSIENT_CODES = frozenset(
    {"RequestLimitExceeded", "Throttling", "InternalError", "ServiceUnavailable", "Unavailable"}
)

AGENT_BUNDLE_PATH = "/agent/bundle.tar.gz"  # where the control plane serves the agent's files
CONTROL_PLANE_URL_VARIABLE = "CONTROLPLANE_URL"
# The names workers/agent/config.py reads.
NODE_TOKEN_VARIABLE = "CONTROLPLANE_NODE_TOKEN"  # noqa: S105 (a name, not a secret)
IMDS_URL_VARIABLE = "AGENT_IMDS_URL"


class CapacityPreference(enum.StrEnum):
    """The same values as the fleet's CapacityPreference choices."""

    SPOT_THEN_ON_DEMAND = "spot_then_on_demand"
    ON_DEMAND_ONLY = "on_demand_only"


@dataclass(frozen=True)
class AwsConfig:
    control_plane_id: str  # tags every instance, so the orphan sweep finds ours and only ours
    control_plane_url: str  # what the agent calls; written into user data
    region: str = "us-east-1"
    endpoint_url: str | None = None  # a moto server in tests
    agent_bundle_url: str = ""  # default: control_plane_url + AGENT_BUNDLE_PATH
    agent_argv: tuple[str, ...] = ("python3", "-m", "workers.agent")
    imds_url: str = "http://169.254.169.254"  # where the agent watches for spot notices
    node_root: str = "/opt/controlplane"
    boot_timeout_s: float = 600.0  # bootstrap waits this long for the instance to run
    poll_interval_s: float = 5.0
    max_attempts: int = 5  # botocore's own retries (throttling, 5xx), standard mode
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0

    def __post_init__(self):
        if not self.control_plane_id:
            raise ConfigurationError("control_plane_id is needed to tag and find our instances.")
        url = urlsplit(self.control_plane_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigurationError(f"{self.control_plane_url!r} is not an http(s) URL.")
        if not self.agent_bundle_url:
            bundle_url = self.control_plane_url.rstrip("/") + AGENT_BUNDLE_PATH
            object.__setattr__(self, "agent_bundle_url", bundle_url)


@dataclass(frozen=True)
class AwsNodeSpec:
    uuid: str
    name: str
    instance_type: str  # e.g. p5.48xlarge
    image_id: str
    pool: str = ""
    team: str = ""
    job: str = ""
    capacity: CapacityPreference = CapacityPreference.SPOT_THEN_ON_DEMAND
    spot_interruption_rate: float | None = None  # the pool's measured rate, 0 to 1
    spot_interruption_threshold: float = 0.2  # above it, the pool launches on-demand
    placement_group: str = ""  # a cluster placement group, for multi-node jobs
    subnet_id: str = ""
    security_group_ids: tuple[str, ...] = ()
    key_name: str = ""
    instance_profile: str = ""  # an IAM instance profile name (or ARN)
    node_token: str = field(default="", repr=False)  # the agent's Bearer token

    def __post_init__(self):
        object.__setattr__(self, "uuid", node_uuid(self.uuid))
        object.__setattr__(self, "capacity", CapacityPreference(self.capacity))
        if not self.instance_type or not self.image_id:
            raise ConfigurationError("An AWS node needs an instance type and an image.")


@dataclass(frozen=True)
class Orphan:
    instance_id: str
    node_uuid: str  # empty when the instance carries our control-plane tag but no node tag
    state: str
    instance_type: str
    launch_time: dt.datetime | None
    tags: dict[str, str]
    terminated: bool


@dataclass(frozen=True)
class SpotPrice:
    availability_zone: str
    instance_type: str
    product_description: str
    price_per_hour: Decimal
    timestamp: dt.datetime


def market_for(spec: AwsNodeSpec) -> tuple[CapacityType, str]:
    """Spot or on-demand for this launch, and why."""
    if spec.capacity == CapacityPreference.ON_DEMAND_ONLY:
        return CapacityType.ON_DEMAND, "the pool runs on-demand only"
    rate = spec.spot_interruption_rate
    if rate is not None and rate > spec.spot_interruption_threshold:
        return CapacityType.ON_DEMAND, (
            f"spot interruption rate {rate:.0%} is above the pool's threshold "
            f"{spec.spot_interruption_threshold:.0%}"
        )
    return CapacityType.SPOT, "spot first"


def user_data(
    *,
    uuid: str,
    control_plane_url: str,
    node_token: str,
    agent_bundle_url: str,
    node_root: str,
    agent_argv: tuple[str, ...],
    imds_url: str = "",
) -> str:
    """The instance's first-boot script: fetch the agent, write its settings, start it.

    Every value is a quoted argument (`quote_argv`), so no URL or token can become
    shell syntax. The agent reads agent.env for the URL and its bootstrap token.
    """
    node_dir = f"{node_root.rstrip('/')}/{NODE_DIR_PREFIX}{node_uuid(uuid)}"
    settings = env_file_text(
        {
            CONTROL_PLANE_URL_VARIABLE: control_plane_url,
            NODE_UUID_VARIABLE: uuid,
            NODE_TOKEN_VARIABLE: node_token,
            IMDS_URL_VARIABLE: imds_url,
        }
    ).splitlines()
    archive = f"{node_dir}/agent-bundle.tar.gz"

    def path(name: str) -> str:
        return quote_argv([f"{node_dir}/{name}"])

    lines = [
        "#!/bin/sh",
        "# Written by the GPU control plane: installs and starts its node agent.",
        "set -eu",
        "umask 077",
        quote_argv(["mkdir", "-p", node_dir]),
        # Jobs run as users of their own and must pass through to their run directories;
        # they list nothing here (the agent opens its packages to them when it starts).
        quote_argv(["chmod", "711", node_root.rstrip("/") or "/", node_dir]),
        quote_argv(["printf", "%s\\n", *settings]) + " > " + path(AGENT_ENV_FILE),
        quote_argv(
            [
                "curl",
                "-fsS",
                "--retry",
                "20",
                "--retry-connrefused",
                "-o",
                archive,
                agent_bundle_url,
            ]
        ),
        quote_argv(["tar", "-xzf", archive, "-C", node_dir]),
        quote_argv(["cd", node_dir]),
        "export " + quote_argv([f"{NODE_UUID_VARIABLE}={uuid}"]),
        "setsid nohup "
        + quote_argv(list(agent_argv))
        + f" >>{path(AGENT_LOG_FILE)} 2>&1 </dev/null &",
        f"echo $! > {path(AGENT_PID_FILE)}",
    ]
    return "\n".join(lines) + "\n"


class AwsProvider:
    kind = "aws"

    def __init__(self, config: AwsConfig, ec2=None):
        self.config = config
        self.ec2 = ec2 if ec2 is not None else self._client(config.region)

    def _client(self, region: str):
        return _ec2_client(
            os.getpid(),
            region,
            self.config.endpoint_url or None,
            self.config.max_attempts,
            self.config.connect_timeout_s,
            self.config.read_timeout_s,
        )

    # --- the interface -----------------------------------------------------------------

    def create(self, spec: AwsNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        report(progress, "look_up", 5, "Looking for an instance already launched for this node.")
        existing = self._find(spec.uuid)
        if existing is not None:
            report(
                progress,
                "launch",
                100,
                f"Instance {existing.instance_id} already exists ({existing.state}); "
                "not launching another.",
            )
            return existing
        if spec.placement_group:
            report(progress, "placement_group", 10, f"Placement group {spec.placement_group}.")
            self.placement_group_ensure(spec.placement_group)

        market, why = market_for(spec)
        report(progress, "launch", 20, f"Launching {spec.instance_type} {market} ({why}).")
        try:
            instance = self._launch(spec, market)
        except ClientError as error:
            code = _code(error)
            if code == "IdempotentParameterMismatch":
                return self._launched_before(spec, error)
            if not (
                market == CapacityType.SPOT
                and code in SPOT_FALLBACK_CODES
                and spec.capacity == CapacityPreference.SPOT_THEN_ON_DEMAND
            ):
                raise _provider_error(error, f"Launching {spec.instance_type}") from error
            report(progress, "launch", 40, f"No spot capacity ({code}); launching on-demand.")
            try:
                instance = self._launch(spec, CapacityType.ON_DEMAND)
            except ClientError as retry_error:
                if _code(retry_error) == "IdempotentParameterMismatch":
                    return self._launched_before(spec, retry_error)
                raise _provider_error(retry_error, f"Launching {spec.instance_type}") from None
        except BotoCoreError as error:
            raise _provider_error(error, f"Launching {spec.instance_type}") from error
        description = _describe_instance(instance, spec.uuid)
        report(progress, "launch", 100, f"Launched {description.instance_id}.")
        return description

    def bootstrap(
        self,
        spec: AwsNodeSpec,
        bundle: Bundle | None = None,
        *,
        restart_agent: bool = False,
        progress: Progress | None = None,
    ) -> BootstrapReport:
        """Wait for the instance to run. Its user data installs and starts the agent,
        which fetches its files and NCCL settings from the control plane itself."""
        node_dir = f"{self.config.node_root.rstrip('/')}/{NODE_DIR_PREFIX}{spec.uuid}"
        deadline = time.monotonic() + self.config.boot_timeout_s
        while True:
            description = self.describe(spec)
            if description.state == MachineState.RUNNING:
                break
            if description.state != MachineState.PENDING:
                raise ProvisioningFailed(
                    f"The instance for node {spec.uuid} is {description.state}, not booting.",
                    retryable=True,
                )
            if time.monotonic() >= deadline:
                raise ProvisioningFailed(
                    f"Instance {description.instance_id} still pending after "
                    f"{self.config.boot_timeout_s:.0f}s.",
                    retryable=True,
                )
            report(progress, "boot", 50, f"Instance {description.instance_id} is pending.")
            time.sleep(self.config.poll_interval_s)
        message = (
            f"Instance {description.instance_id} is running; its user data installs and "
            "starts the agent, which registers itself."
        )
        report(progress, "boot", 100, message)
        return BootstrapReport(
            spec.uuid, node_dir, agent_pid=None, agent_started=False, message=message
        )

    def describe(self, spec: AwsNodeSpec) -> NodeDescription:
        found = self._find(spec.uuid)
        return found or NodeDescription(uuid=spec.uuid, state=MachineState.ABSENT)

    def terminate(self, spec: AwsNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        """Terminate every live instance tagged with this node (normally one)."""
        instances = list(self._instances(_our_filters(self.config, node=spec.uuid)))
        if not instances:
            report(progress, "terminate", 100, "No instance left for this node.")
            return NodeDescription(uuid=spec.uuid, state=MachineState.ABSENT)
        ids = [instance["InstanceId"] for instance in instances]
        report(progress, "terminate", 30, f"Terminating {', '.join(ids)}.")
        with _aws_errors("Terminating"):
            answer = self.ec2.terminate_instances(InstanceIds=ids)
        states = {
            change["InstanceId"]: change["CurrentState"]["Name"]
            for change in answer["TerminatingInstances"]
        }
        state = states.get(ids[0], MachineState.SHUTTING_DOWN)
        report(progress, "terminate", 100, f"{ids[0]} is {state}.")
        return dataclasses.replace(
            _describe_instance(instances[0], spec.uuid), state=MachineState(state)
        )

    # --- beyond the interface ---------------------------------------------------------

    def orphan_sweep(self, known_uuids: Iterable[str], *, terminate: bool = False) -> list[Orphan]:
        """Live instances with our control-plane tag whose node UUID is not known.

        With `terminate`, they are terminated too; without, they are only reported.
        """
        known = {str(uuid).lower() for uuid in known_uuids}
        orphans = []
        for instance in self._instances(_our_filters(self.config)):
            tags = _tags(instance)
            if tags.get(TAG_NODE_UUID, "").lower() in known:
                continue
            orphans.append(instance)
        if terminate and orphans:
            ids = [instance["InstanceId"] for instance in orphans]
            logger.warning("Terminating orphan instances %s", ", ".join(ids))
            self.instances_terminate(ids)
        return [
            Orphan(
                instance_id=instance["InstanceId"],
                node_uuid=_tags(instance).get(TAG_NODE_UUID, ""),
                state=instance["State"]["Name"],
                instance_type=instance.get("InstanceType", ""),
                launch_time=instance.get("LaunchTime"),
                tags=_tags(instance),
                terminated=terminate,
            )
            for instance in orphans
        ]

    def instances_terminate(self, instance_ids: Iterable[str]) -> None:
        """Terminate these instances (orphans the caller chose), in batches of 500."""
        ids = list(instance_ids)
        with _aws_errors("Terminating instances"):
            for start in range(0, len(ids), 500):
                self.ec2.terminate_instances(InstanceIds=ids[start : start + 500])

    def placement_group_ensure(self, name: str) -> None:
        """Create the cluster placement group; one that already exists is done."""
        try:
            self.ec2.create_placement_group(
                GroupName=name,
                Strategy="cluster",
                TagSpecifications=[
                    {
                        "ResourceType": "placement-group",
                        "Tags": [{"Key": TAG_CONTROL_PLANE, "Value": self.config.control_plane_id}],
                    }
                ],
            )
        except ClientError as error:
            if _code(error) != "InvalidPlacementGroup.Duplicate":
                raise _provider_error(error, f"Creating placement group {name}") from error
        except BotoCoreError as error:
            raise _provider_error(error, f"Creating placement group {name}") from error

    def placement_group_delete(self, name: str) -> bool:
        """Delete the group once no live instance is in it; false while some still are."""
        filters = [
            {"Name": "placement-group-name", "Values": [name]},
            {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
        ]
        if any(True for _ in self._instances(filters)):
            return False
        try:
            self.ec2.delete_placement_group(GroupName=name)
        except ClientError as error:
            code = _code(error)
            if code == "InvalidPlacementGroup.Unknown":
                return True
            if code == "InvalidPlacementGroup.InUse":
                return False  # instances still shutting down
            raise _provider_error(error, f"Deleting placement group {name}") from error
        except BotoCoreError as error:
            raise _provider_error(error, f"Deleting placement group {name}") from error
        return True

    def placement_group_name(self, job: str) -> str:
        return f"cp-{self.config.control_plane_id}-job-{job}"

    def spot_prices(
        self,
        instance_type: str,
        since: dt.datetime,
        *,
        region: str | None = None,
        until: dt.datetime | None = None,
        product_description: str = "Linux/UNIX",
    ) -> list[SpotPrice]:
        """Spot price history per availability zone, oldest first."""
        ec2 = self.ec2 if region in (None, self.config.region) else self._client(region)
        arguments = {
            "InstanceTypes": [instance_type],
            "ProductDescriptions": [product_description],
            "StartTime": since,
        }
        if until is not None:
            arguments["EndTime"] = until
        prices = []
        with _aws_errors("Reading spot prices"):
            for page in ec2.get_paginator("describe_spot_price_history").paginate(**arguments):
                for entry in page["SpotPriceHistory"]:
                    prices.append(
                        SpotPrice(
                            availability_zone=entry["AvailabilityZone"],
                            instance_type=entry["InstanceType"],
                            product_description=entry["ProductDescription"],
                            price_per_hour=Decimal(entry["SpotPrice"]),
                            timestamp=entry["Timestamp"],
                        )
                    )
        return sorted(prices, key=lambda price: (price.timestamp, price.availability_zone))

    # --- launching and finding --------------------------------------------------------

    def _launch(self, spec: AwsNodeSpec, market: CapacityType) -> dict:
        tags = [
            {"Key": "Name", "Value": spec.name},
            {"Key": TAG_CONTROL_PLANE, "Value": self.config.control_plane_id},
            {"Key": TAG_NODE_UUID, "Value": spec.uuid},
            {"Key": TAG_TEAM, "Value": spec.team},
            {"Key": TAG_JOB, "Value": spec.job},
            {"Key": TAG_POOL, "Value": spec.pool},
        ]
        arguments = {
            "ClientToken": spec.uuid,
            "ImageId": spec.image_id,
            "InstanceType": spec.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "UserData": user_data(
                uuid=spec.uuid,
                control_plane_url=self.config.control_plane_url,
                node_token=spec.node_token,
                agent_bundle_url=self.config.agent_bundle_url,
                node_root=self.config.node_root,
                agent_argv=self.config.agent_argv,
                imds_url=self.config.imds_url,
            ),
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
            # IMDSv2 only: the agent polls spot/instance-action with a session token.
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
        }
        if market == CapacityType.SPOT:
            arguments["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        if spec.placement_group:
            arguments["Placement"] = {"GroupName": spec.placement_group}
        if spec.subnet_id:
            arguments["SubnetId"] = spec.subnet_id
        if spec.security_group_ids:
            arguments["SecurityGroupIds"] = list(spec.security_group_ids)
        if spec.key_name:
            arguments["KeyName"] = spec.key_name
        if spec.instance_profile:
            key = "Arn" if spec.instance_profile.startswith("arn:") else "Name"
            arguments["IamInstanceProfile"] = {key: spec.instance_profile}
        logger.info("run_instances %s %s for node %s", spec.instance_type, market, spec.uuid)
        return self.ec2.run_instances(**arguments)["Instances"][0]

    def _launched_before(self, spec: AwsNodeSpec, error: ClientError) -> NodeDescription:
        # A launch with this token succeeded earlier with other settings (spot then,
        # on-demand now): that instance is the node's. Find it; never launch a second.
        found = self._find(spec.uuid)
        if found is not None:
            return found
        raise ProvisioningFailed(
            f"An earlier launch for node {spec.uuid} exists but is not visible yet: {error}",
            retryable=True,
        )

    def _find(self, uuid: str) -> NodeDescription | None:
        instances = sorted(
            self._instances(_our_filters(self.config, node=uuid)),
            key=_launched_at,
        )
        if not instances:
            return None
        if len(instances) > 1:
            ids = ", ".join(instance["InstanceId"] for instance in instances)
            logger.error("Node %s has %d live instances: %s", uuid, len(instances), ids)
        return _describe_instance(instances[0], uuid)

    def _instances(self, filters: list[dict]) -> Iterator[dict]:
        with _aws_errors("Listing instances"):
            pages = self.ec2.get_paginator("describe_instances").paginate(Filters=filters)
            for page in pages:
                for reservation in page["Reservations"]:
                    yield from reservation["Instances"]


@functools.lru_cache(maxsize=32)
def _ec2_client(
    pid: int,
    region: str,
    endpoint_url: str | None,
    max_attempts: int,
    connect_timeout_s: float,
    read_timeout_s: float,
):
    """One client per process and settings: a client is thread-safe and slow to build
    (it loads EC2's service model), but not safe to share across a fork."""
    return boto3.session.Session().client(
        "ec2",
        region_name=region,
        endpoint_url=endpoint_url,
        config=botocore.config.Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
        ),
    )


def _our_filters(config: AwsConfig, *, node: str | None = None) -> list[dict]:
    filters = [
        {"Name": f"tag:{TAG_CONTROL_PLANE}", "Values": [config.control_plane_id]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
    ]
    if node is not None:
        filters.append({"Name": f"tag:{TAG_NODE_UUID}", "Values": [node]})
    return filters


def _launched_at(instance: dict) -> float:
    launch_time = instance.get("LaunchTime")
    return launch_time.timestamp() if launch_time is not None else float("inf")


def _tags(instance: dict) -> dict[str, str]:
    return {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}


def _describe_instance(instance: dict, uuid: str) -> NodeDescription:
    spot = instance.get("InstanceLifecycle") == "spot"
    return NodeDescription(
        uuid=uuid,
        state=MachineState(instance["State"]["Name"]),
        capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND,
        address=instance.get("PrivateIpAddress", ""),
        instance_id=instance["InstanceId"],
        instance_type=instance.get("InstanceType", ""),
        launch_time=instance.get("LaunchTime"),
        placement_group=instance.get("Placement", {}).get("GroupName", ""),
        tags=_tags(instance),
    )


def _code(error: ClientError) -> str:
    return error.response.get("Error", {}).get("Code", "")


def _provider_error(error: Exception, what: str) -> ProviderError:
    if isinstance(error, NoCredentialsError):
        return ConfigurationError(f"{what}: no AWS credentials are configured.")
    if isinstance(error, BotoCoreError):
        return ProvisioningFailed(f"{what}: {error}", retryable=True)
    code = _code(error)
    message = f"{what}: {code}: {error.response.get('Error', {}).get('Message', '')}"
    if code in _NO_CAPACITY_CODES:
        return CapacityUnavailable(message, retryable=True)
    if code in _QUOTA_CODES:
        return CapacityUnavailable(message + " (raise the account's quota)", retryable=False)
    return ProvisioningFailed(message, retryable=code in _TRANSIENT_CODES)


@contextlib.contextmanager
def _aws_errors(what: str):
    try:
        yield
    except (ClientError, BotoCoreError) as error:
        raise _provider_error(error, what) from error
