"""The AWS provider against a real moto server on 127.0.0.1 (see conftest.py).

moto runs EC2's instance calls for real, but ignores ClientToken, has no
placement groups worth the name, returns fixed spot prices and never runs out
of capacity. Those calls are tested further down with botocore's Stubber, on
responses shaped like the real API's (the Stubber checks them against the EC2
service model).
"""

import base64
import datetime as dt
import os
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import boto3
import pytest
from botocore.stub import ANY, Stubber

from workers.providers.aws import (
    AwsConfig,
    AwsNodeSpec,
    AwsProvider,
    CapacityPreference,
    market_for,
    user_data,
)
from workers.providers.errors import CapacityUnavailable, ConfigurationError, ProvisioningFailed
from workers.providers.interface import CapacityType, MachineState

IMAGE = "ami-0a1b2c3d4e5f60718"
CONTROL_PLANE = "cp-test"


def config_for(endpoint: str | None = None, **overrides) -> AwsConfig:
    values = {
        "control_plane_id": CONTROL_PLANE,
        "control_plane_url": "https://cp.example.com",
        "endpoint_url": endpoint,
        "poll_interval_s": 0.05,
        "boot_timeout_s": 5,
    }
    return AwsConfig(**(values | overrides))


def node(**overrides) -> AwsNodeSpec:
    values = {
        "uuid": str(uuid.uuid4()),
        "name": "aws-use1-p5-0001",
        "instance_type": "p5.48xlarge",
        "image_id": IMAGE,
        "pool": "aws-use1-p5",
        "team": "foundation",
        "job": "42",
        "node_token": "cpn_secret",
    }
    return AwsNodeSpec(**(values | overrides))


@pytest.fixture
def provider(aws_endpoint) -> AwsProvider:
    # The provider makes its own boto3 client from the config, as in production.
    # A control-plane id of its own keeps each test's instances apart on the shared
    # moto server (resetting moto costs more than the test).
    return AwsProvider(config_for(aws_endpoint, control_plane_id=f"cp-{uuid.uuid4().hex[:8]}"))


def instances(provider: AwsProvider, **filters) -> list[dict]:
    """This test's instances (those tagged with its control-plane id), in any state."""
    filters = {"tag:controlplane:id": provider.config.control_plane_id} | filters
    answer = provider.ec2.describe_instances(
        Filters=[{"Name": name, "Values": [value]} for name, value in filters.items()]
    )
    return [i for reservation in answer["Reservations"] for i in reservation["Instances"]]


def tags_of(instance: dict) -> dict:
    return {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}


# --- against moto ----------------------------------------------------------------------------


def test_an_on_demand_launch_is_tagged_and_described(provider):
    spec = node(capacity=CapacityPreference.ON_DEMAND_ONLY)

    launched = provider.create(spec)

    assert launched.capacity_type == CapacityType.ON_DEMAND
    (instance,) = instances(provider)
    assert instance["InstanceId"] == launched.instance_id
    assert instance["InstanceType"] == "p5.48xlarge"
    assert "InstanceLifecycle" not in instance
    assert tags_of(instance) == {
        "Name": "aws-use1-p5-0001",
        "controlplane:id": provider.config.control_plane_id,
        "controlplane:node-uuid": spec.uuid,
        "controlplane:team": "foundation",
        "controlplane:job": "42",
        "controlplane:pool": "aws-use1-p5",
    }
    described = provider.describe(spec)
    assert described.instance_id == launched.instance_id
    assert described.state == MachineState.RUNNING
    assert described.capacity_type == CapacityType.ON_DEMAND
    assert described.instance_type == "p5.48xlarge"
    assert described.address == instance["PrivateIpAddress"]
    assert isinstance(described.launch_time, dt.datetime)


def test_a_spot_launch_asks_for_one_time_spot_capacity(provider):
    spec = node()

    launched = provider.create(spec)

    assert launched.capacity_type == CapacityType.SPOT
    (instance,) = instances(provider)
    assert instance["InstanceLifecycle"] == "spot"
    assert provider.describe(spec).capacity_type == CapacityType.SPOT


def test_a_create_repeated_after_a_lost_worker_launches_no_second_instance(provider):
    spec = node()
    first = provider.create(spec)
    # The worker died after run_instances, before the instance id reached the
    # database: the re-driven task knows only the node's UUID.
    steps = []

    again = provider.create(spec, progress=lambda *step: steps.append(step))
    # Even if the pool has turned on-demand in between.
    on_demand_now = provider.create(node(uuid=spec.uuid, spot_interruption_rate=0.9))

    assert again.instance_id == first.instance_id == on_demand_now.instance_id
    assert len(instances(provider, **{"tag:controlplane:node-uuid": spec.uuid})) == 1
    assert "not launching another" in steps[-1][2]


def test_terminate_ends_the_instance_and_a_second_terminate_does_nothing(provider):
    spec = node()
    launched = provider.create(spec)

    ended = provider.terminate(spec)

    assert ended.instance_id == launched.instance_id
    assert ended.state in (MachineState.SHUTTING_DOWN, MachineState.TERMINATED)
    (instance,) = instances(provider)
    assert instance["State"]["Name"] in ("shutting-down", "terminated")
    assert provider.describe(spec).state == MachineState.ABSENT
    assert provider.terminate(spec).state == MachineState.ABSENT


def test_bootstrap_waits_for_the_instance_to_run(provider):
    spec = node()
    provider.create(spec)

    report = provider.bootstrap(spec)

    assert report.agent_pid is None
    assert "user data installs and starts the agent" in report.message
    with pytest.raises(ProvisioningFailed) as failed:
        provider.bootstrap(node())  # never created
    assert failed.value.retryable is True


def test_the_orphan_sweep_finds_our_instances_unknown_to_the_database(provider, aws_endpoint):
    known = node()
    orphan = node()
    provider.create(known)
    orphan_id = provider.create(orphan).instance_id
    # Another control plane's instance, and one nobody tagged: neither is ours to touch.
    AwsProvider(config_for(aws_endpoint, control_plane_id="cp-other")).create(node())
    provider.ec2.run_instances(ImageId=IMAGE, InstanceType="t3.micro", MinCount=1, MaxCount=1)

    reported = provider.orphan_sweep([known.uuid])

    assert [(o.instance_id, o.node_uuid, o.terminated) for o in reported] == [
        (orphan_id, orphan.uuid, False)
    ]
    assert reported[0].tags["controlplane:id"] == provider.config.control_plane_id
    assert provider.describe(orphan).state == MachineState.RUNNING  # reported, not touched

    swept = provider.orphan_sweep([known.uuid], terminate=True)

    assert [o.instance_id for o in swept] == [orphan_id]
    assert swept[0].terminated is True
    assert provider.describe(orphan).state == MachineState.ABSENT
    assert provider.describe(known).state == MachineState.RUNNING
    assert provider.orphan_sweep([known.uuid]) == []


def test_the_instance_gets_the_user_data_that_installs_the_agent(provider):
    spec = node()
    launched = provider.create(spec)

    answer = provider.ec2.describe_instance_attribute(
        InstanceId=launched.instance_id, Attribute="userData"
    )

    script = base64.b64decode(answer["UserData"]["Value"]).decode()
    assert script.startswith("#!/bin/sh\n")
    assert "CONTROLPLANE_NODE_TOKEN=cpn_secret" in script
    assert "AGENT_IMDS_URL=http://169.254.169.254" in script
    assert "https://cp.example.com/agent/bundle.tar.gz" in script
    assert "cpn_secret" not in repr(spec), "the token stays out of logs"


def test_the_user_data_script_runs_and_keeps_hostile_values_literal(tmp_path):
    """The first-boot script, run here for real with the agent fetched over file://."""
    bundle = tmp_path / "bundle.tar.gz"
    package = tmp_path / "src" / "workers" / "agent"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""agent"""\n')
    with tarfile.open(bundle, "w:gz") as archive:
        archive.add(tmp_path / "src" / "workers", arcname="workers")
    marker = tmp_path / "injected"
    token = f"cpn_'; touch {marker}; echo '$(touch {marker})"
    node_uuid = str(uuid.uuid4())
    script = user_data(
        uuid=node_uuid,
        control_plane_url="https://cp.example.com",
        node_token=token,
        agent_bundle_url=bundle.as_uri(),
        node_root=str(tmp_path / "opt"),
        agent_argv=(sys.executable, "-c", "import time; time.sleep(600)"),
        imds_url="http://127.0.0.1:1",
    )

    subprocess.run(["sh", "-c", script], check=True, timeout=60, cwd=tmp_path)

    node_dir = tmp_path / "opt" / f"node-{node_uuid}"
    assert (node_dir / "agent.env").read_text().splitlines() == [
        "CONTROLPLANE_URL=https://cp.example.com",
        f"CONTROLPLANE_NODE_UUID={node_uuid}",
        f"CONTROLPLANE_NODE_TOKEN={token}",
        "AGENT_IMDS_URL=http://127.0.0.1:1",
    ]
    assert (node_dir / "workers" / "agent" / "__init__.py").is_file()
    assert not marker.exists()
    pid = int((node_dir / "agent.pid").read_text())
    try:
        # The script has returned; its background child may not have reached setsid yet.
        deadline = time.monotonic() + 10
        while os.getsid(pid) != pid and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.getsid(pid) == pid, "the agent runs in a session of its own"
        # A process in the middle of exec reads an empty environment: read until it is done.
        environ = [b""]
        while environ == [b""] and time.monotonic() < deadline:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            time.sleep(0.02)
        assert f"CONTROLPLANE_NODE_UUID={node_uuid}".encode() in environ
    finally:
        os.kill(pid, signal.SIGKILL)


# --- with botocore's Stubber, where moto cannot stand in -------------------------------------


@pytest.fixture
def stubbed():
    """A provider on a client that never leaves the process; responses are queued per test."""
    client = boto3.client(
        "ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y"
    )
    with Stubber(client) as stubber:
        yield AwsProvider(config_for(), ec2=client), stubber
        stubber.assert_no_pending_responses()


def our_filters(node_uuid: str | None = None) -> list[dict]:
    filters = [
        {"Name": "tag:controlplane:id", "Values": [CONTROL_PLANE]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
    ]
    if node_uuid:
        filters.append({"Name": "tag:controlplane:node-uuid", "Values": [node_uuid]})
    return filters


def reservation(spec: AwsNodeSpec, *, spot: bool, placement_group: str = "") -> dict:
    """A RunInstances answer as EC2 gives it (trimmed to the fields we read and a few more)."""
    instance = {
        "InstanceId": "i-0f1e2d3c4b5a69788",
        "ImageId": spec.image_id,
        "InstanceType": spec.instance_type,
        "State": {"Code": 0, "Name": "pending"},
        "PrivateIpAddress": "10.20.30.40",
        "LaunchTime": dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC),
        "Placement": {
            "AvailabilityZone": "us-east-1a",
            "GroupName": placement_group,
            "Tenancy": "default",
        },
        "ClientToken": spec.uuid,
        "Tags": [
            {"Key": "controlplane:id", "Value": CONTROL_PLANE},
            {"Key": "controlplane:node-uuid", "Value": spec.uuid},
        ],
    }
    if spot:
        instance["InstanceLifecycle"] = "spot"
        instance["SpotInstanceRequestId"] = "sir-8e2kq3xg"
    return {
        "ReservationId": "r-0123456789abcdef0",
        "OwnerId": "123456789012",
        "Groups": [],
        "Instances": [instance],
    }


SPOT_OPTIONS = {
    "MarketType": "spot",
    "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
}


def launch_params(spec: AwsNodeSpec, *, spot: bool, **extra) -> dict:
    params = {
        "ClientToken": spec.uuid,
        "ImageId": spec.image_id,
        "InstanceType": spec.instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "UserData": ANY,
        "TagSpecifications": ANY,
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
    }
    if spot:
        params["InstanceMarketOptions"] = SPOT_OPTIONS
    return params | extra


def test_the_launch_carries_the_node_uuid_as_its_client_token(stubbed):
    provider, stubber = stubbed
    spec = node()
    stubber.add_response(
        "describe_instances", {"Reservations": []}, {"Filters": our_filters(spec.uuid)}
    )
    stubber.add_response(
        "run_instances", reservation(spec, spot=True), launch_params(spec, spot=True)
    )

    launched = provider.create(spec)

    assert launched.instance_id == "i-0f1e2d3c4b5a69788"
    assert launched.capacity_type == CapacityType.SPOT


@pytest.mark.parametrize("code", ["InsufficientInstanceCapacity", "MaxSpotInstanceCountExceeded"])
def test_no_spot_capacity_falls_back_to_on_demand(stubbed, code):
    provider, stubber = stubbed
    spec = node()
    stubber.add_response(
        "describe_instances", {"Reservations": []}, {"Filters": our_filters(spec.uuid)}
    )
    stubber.add_client_error(
        "run_instances",
        service_error_code=code,
        service_message="There is no Spot capacity available that matches your request.",
        http_status_code=500 if code == "InsufficientInstanceCapacity" else 400,
        expected_params=launch_params(spec, spot=True),
    )
    # The same token: a token binds only to a launch that succeeded.
    stubber.add_response(
        "run_instances", reservation(spec, spot=False), launch_params(spec, spot=False)
    )
    steps = []

    launched = provider.create(spec, progress=lambda *step: steps.append(step))

    assert launched.capacity_type == CapacityType.ON_DEMAND
    assert any(code in message for _, _, message in steps)


def test_a_pool_interrupted_too_often_launches_on_demand_at_once(stubbed):
    provider, stubber = stubbed
    spec = node(spot_interruption_rate=0.35, spot_interruption_threshold=0.2)
    stubber.add_response(
        "describe_instances", {"Reservations": []}, {"Filters": our_filters(spec.uuid)}
    )
    stubber.add_response(
        "run_instances", reservation(spec, spot=False), launch_params(spec, spot=False)
    )

    assert provider.create(spec).capacity_type == CapacityType.ON_DEMAND
    assert market_for(spec) == (
        CapacityType.ON_DEMAND,
        "spot interruption rate 35% is above the pool's threshold 20%",
    )
    assert market_for(node(spot_interruption_rate=0.1))[0] == CapacityType.SPOT


def test_no_on_demand_capacity_is_capacity_unavailable_and_retryable(stubbed):
    provider, stubber = stubbed
    spec = node(capacity=CapacityPreference.ON_DEMAND_ONLY)
    stubber.add_response(
        "describe_instances", {"Reservations": []}, {"Filters": our_filters(spec.uuid)}
    )
    stubber.add_client_error(
        "run_instances",
        service_error_code="InsufficientInstanceCapacity",
        http_status_code=500,
        expected_params=launch_params(spec, spot=False),
    )

    with pytest.raises(CapacityUnavailable) as failed:
        provider.create(spec)

    assert failed.value.retryable is True


def test_a_quota_error_after_the_fallback_needs_a_person(stubbed):
    provider, stubber = stubbed
    spec = node()
    stubber.add_response("describe_instances", {"Reservations": []})
    stubber.add_client_error("run_instances", service_error_code="InsufficientInstanceCapacity")
    stubber.add_client_error("run_instances", service_error_code="VcpuLimitExceeded")

    with pytest.raises(CapacityUnavailable) as failed:
        provider.create(spec)

    assert failed.value.retryable is False
    assert "quota" in str(failed.value)


def test_a_token_already_used_with_other_settings_returns_that_instance(stubbed):
    # An earlier launch succeeded as spot but was not yet visible to the look-up;
    # now the pool is on-demand. EC2 refuses the token: the node has its instance.
    provider, stubber = stubbed
    spec = node(spot_interruption_rate=0.9)
    stubber.add_response("describe_instances", {"Reservations": []})
    stubber.add_client_error("run_instances", service_error_code="IdempotentParameterMismatch")
    stubber.add_response(
        "describe_instances",
        {"Reservations": [reservation(spec, spot=True)]},
        {"Filters": our_filters(spec.uuid)},
    )

    found = provider.create(spec)

    assert found.instance_id == "i-0f1e2d3c4b5a69788"
    assert found.capacity_type == CapacityType.SPOT


def test_a_multi_node_job_gets_a_cluster_placement_group_created_idempotently(stubbed):
    provider, stubber = stubbed
    group = provider.placement_group_name("42")
    spec = node(placement_group=group)
    stubber.add_response("describe_instances", {"Reservations": []})
    # Another node of the same job made the group first.
    stubber.add_client_error(
        "create_placement_group",
        service_error_code="InvalidPlacementGroup.Duplicate",
        service_message=f"The Placement Group '{group}' already exists.",
        expected_params={
            "GroupName": group,
            "Strategy": "cluster",
            "TagSpecifications": [
                {
                    "ResourceType": "placement-group",
                    "Tags": [{"Key": "controlplane:id", "Value": CONTROL_PLANE}],
                }
            ],
        },
    )
    stubber.add_response(
        "run_instances",
        reservation(spec, spot=True, placement_group=group),
        launch_params(spec, spot=True, Placement={"GroupName": group}),
    )

    launched = provider.create(spec)

    assert group == "cp-cp-test-job-42"
    assert launched.placement_group == group


def test_a_placement_group_is_deleted_only_once_its_nodes_are_gone(stubbed):
    provider, stubber = stubbed
    group = "cp-cp-test-job-42"
    in_group = [
        {"Name": "placement-group-name", "Values": [group]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
    ]
    still_there = reservation(node(), spot=True, placement_group=group)
    stubber.add_response(
        "describe_instances", {"Reservations": [still_there]}, {"Filters": in_group}
    )
    stubber.add_response("describe_instances", {"Reservations": []}, {"Filters": in_group})
    stubber.add_response("delete_placement_group", {}, {"GroupName": group})
    stubber.add_response("describe_instances", {"Reservations": []}, {"Filters": in_group})
    stubber.add_client_error("delete_placement_group", "InvalidPlacementGroup.Unknown")

    assert provider.placement_group_delete(group) is False  # a node still runs in it
    assert provider.placement_group_delete(group) is True
    assert provider.placement_group_delete(group) is True  # already gone: done


def test_spot_prices_are_read_from_every_page_of_the_history(stubbed):
    provider, stubber = stubbed
    since = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    asked = {
        "InstanceTypes": ["p5.48xlarge"],
        "ProductDescriptions": ["Linux/UNIX"],
        "StartTime": since,
    }

    def price(zone: str, value: str, hour: int) -> dict:
        return {
            "AvailabilityZone": zone,
            "InstanceType": "p5.48xlarge",
            "ProductDescription": "Linux/UNIX",
            "SpotPrice": value,
            "Timestamp": dt.datetime(2026, 3, 1, hour, tzinfo=dt.UTC),
        }

    stubber.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": [price("us-east-1b", "31.464000", 9)], "NextToken": "page-2"},
        asked,
    )
    stubber.add_response(
        "describe_spot_price_history",
        {"SpotPriceHistory": [price("us-east-1a", "30.118200", 8)], "NextToken": ""},
        asked | {"NextToken": "page-2"},
    )

    prices = provider.spot_prices("p5.48xlarge", since)

    assert [(p.availability_zone, p.price_per_hour) for p in prices] == [
        ("us-east-1a", Decimal("30.118200")),
        ("us-east-1b", Decimal("31.464000")),
    ]
    assert prices[0].timestamp == dt.datetime(2026, 3, 1, 8, tzinfo=dt.UTC)


def test_throttling_that_outlasts_botocores_retries_is_retryable(stubbed):
    provider, stubber = stubbed
    stubber.add_client_error("describe_instances", service_error_code="RequestLimitExceeded")

    with pytest.raises(ProvisioningFailed) as failed:
        provider.create(node())

    assert failed.value.retryable is True


def test_configs_and_specs_are_checked():
    with pytest.raises(ConfigurationError):
        AwsConfig(control_plane_id="", control_plane_url="https://cp.example.com")
    with pytest.raises(ConfigurationError):
        AwsConfig(control_plane_id="cp", control_plane_url="cp.example.com; reboot")
    with pytest.raises(ConfigurationError):
        node(uuid="not-a-uuid")
    with pytest.raises(ConfigurationError):
        user_data(
            uuid=str(uuid.uuid4()),
            control_plane_url="https://cp.example.com",
            node_token="two\nlines",
            agent_bundle_url="https://cp.example.com/agent/bundle.tar.gz",
            node_root="/opt/controlplane",
            agent_argv=("python3", "-m", "workers.agent"),
        )
