"""Cloud nodes end to end against a real moto server on 127.0.0.1: bursts from the
scheduler's pass, provisioning through the AWS provider, a worker killed mid-launch,
idle scale-down and the orphan sweep.

moto does not run user data, so an instance's agent never calls back: the tests go
as far as a running instance (BOOTSTRAPPING) and drive registration through
apps.fleet.agents.node_agent_register where they need a READY node. Each test tags its
instances with a control-plane id of its own, so tests sharing the moto server never
see each other's instances.
"""

import base64
import copy
import dataclasses
import datetime as dt
import logging
import shlex
import uuid
from decimal import Decimal

import pytest
from botocore.stub import ANY, Stubber
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.models import AuditEvent
from apps.costs import services as costs
from apps.fleet import agents, cloud
from apps.fleet import services as fleet
from apps.fleet.models import Node, NodeState, OrphanInstance
from apps.jobs import services as jobs
from apps.jobs.models import Allocation, JobState
from apps.jobs.scheduler import apply
from apps.jobs.scheduler.run import scheduling_pass
from apps.jobs.scheduler.snapshot import BurstRequest
from controlplane.celery import app
from tests import factories
from tests.apps.jobs.conftest import command_spec
from tests.workers.providers.test_aws import launch_params, reservation
from workers.providers.aws import AwsNodeSpec, AwsProvider
from workers.providers.errors import ProvisioningFailed
from workers.tasks.cloud import aws_config, cloud_sweep_run, orphan_sweep_run
from workers.tasks.locks import single_flight
from workers.tasks.provisioning import provision_node

pytestmark = pytest.mark.django_db
S = NodeState
IMAGE = "ami-0a1b2c3d4e5f60718"


@pytest.fixture
def aws(settings, aws_endpoint) -> AwsProvider:
    """Settings pointing at moto, and a provider (as the tasks build it) to inspect it."""
    settings.AWS_ENDPOINT_URL = aws_endpoint
    settings.CONTROLPLANE_ID = f"cp-test-{uuid.uuid4().hex[:8]}"
    settings.CONTROLPLANE_URL = "https://cp.example.com"
    return AwsProvider(aws_config("us-east-1"))


def cloud_pool(slug: str = "aws-test", **extra):
    fields = {
        "name": slug,
        "slug": slug,
        "kind": "cloud",
        "gpu_type": "H100",
        "region": "us-east-1",
        "max_nodes": 8,
        "burst_delay_s": 0,
        "idle_timeout_s": 600,
        "enabled": True,
        "image_id": IMAGE,
        "instance_types": [factories.instance_type("p5.48xlarge")],
    }
    return fleet.pool_create(by=None, **(fields | extra))


@pytest.fixture
def pool(db):
    return cloud_pool()


def instances(provider: AwsProvider, **filters) -> list[dict]:
    """The test's instances (its control-plane id), in any state."""
    filters = {"tag:controlplane:id": provider.config.control_plane_id} | filters
    answer = provider.ec2.describe_instances(
        Filters=[{"Name": name, "Values": [value]} for name, value in filters.items()]
    )
    return [i for reservation in answer["Reservations"] for i in reservation["Instances"]]


def of_node(provider: AwsProvider, node: Node) -> list[dict]:
    return instances(provider, **{"tag:controlplane:node-uuid": str(node.uuid)})


def tags_of(instance: dict) -> dict:
    return {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}


def waiting_job(team, *, nodes: int = 2, spot: bool = True):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    user = factories.make_member(team=team)
    spec = command_spec(
        team,
        resources={"gpu_type": "H100", "nodes": nodes, "gpus_per_node": 8},
        placement={"where": "cloud", "spot": spot},
    )
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=user)
    return job


def burst_node(pool, *, job, spot: bool = True) -> Node:
    """A REQUESTED burst node for a one-node job, as a scheduling pass would make it."""
    outcome = cloud.burst_nodes_request(
        asks=[
            cloud.BurstAsk(
                job_id=job.pk,
                pool_id=pool.pk,
                nodes=1,
                gpus_per_node=8,
                spot=spot,
            )
        ]
    )
    (node_id,) = outcome.node_ids
    return Node.objects.get(pk=node_id)


def register(node: Node) -> Node:
    """What the node's agent would do once its user data started it: register, healthy."""
    identity = agents.AgentIdentity(node_id=node.pk, node_uuid=str(node.uuid), name=node.name)
    gpus = [
        {"index": i, "uuid": f"GPU-{node.uuid}-{i}", "name": "NVIDIA H100 80GB HBM3"}
        for i in range(node.gpu_count)
    ]
    agents.node_agent_register(
        identity=identity,
        report={
            "version": "1",
            "metrics": {"source": "nvidia-smi", "gpus": gpus},
            "isolation": {"mode": "user"},  # the agent runs as root on the instance
        },
    )
    return Node.objects.get(pk=node.pk)


def ready_burst_node(pool, team) -> Node:
    node = burst_node(pool, job=waiting_job(team, nodes=1))
    assert provision_node(node.pk) == S.BOOTSTRAPPING
    node = register(Node.objects.get(pk=node.pk))
    assert node.state == S.READY
    return node


# --- scale up ------------------------------------------------------------------------------------


def test_a_waiting_job_gets_burst_nodes_once_not_on_every_pass(pool, team):
    job = waiting_job(team, nodes=2)

    first = scheduling_pass()
    second = scheduling_pass()

    assert first.bursts == second.bursts == 1  # the planner still asks...
    made = list(Node.objects.filter(burst_job=job))
    assert len(made) == 2  # ...but the job got its nodes once
    for node in made:
        assert (node.pool, node.provider, node.state) == (pool, "aws", S.REQUESTED)
        assert (node.capacity_type, node.instance_type.name, node.gpu_count) == (
            "spot",
            "p5.48xlarge",
            8,
        )
    assert {node.placement_group for node in made} == {f"{cloud.placement_group_for(job.pk)}"}
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert "requested from cloud pool" in job.pending_reason
    assert AuditEvent.objects.filter(action="node.burst").count() == 2


def test_a_job_asks_again_only_for_what_it_lacks_and_not_right_after_a_failure(pool, team):
    job = waiting_job(team, nodes=2)
    scheduling_pass()
    first, second = Node.objects.filter(burst_job=job)
    # One came up, one failed: no burst until the retry delay, then one node, not two.
    first = fleet.node_transition(node=first, to=S.PROVISIONING, reason="t", by=None)
    first = fleet.node_transition(node=first, to=S.BOOTSTRAPPING, reason="t", by=None)
    fleet.node_transition(node=first, to=S.READY, reason="t", by=None)
    fleet.node_transition(node=second, to=S.FAILED, reason="no capacity", by=None)
    ask = cloud.BurstAsk(job_id=job.pk, pool_id=pool.pk, nodes=2, gpus_per_node=8, spot=True)

    soon = cloud.burst_nodes_request(asks=[ask])
    later = cloud.burst_nodes_request(asks=[ask], now=timezone.now() + dt.timedelta(hours=1))

    assert soon.node_ids == [] and "failed in the last" in soon.skipped[job.pk]
    assert len(later.node_ids) == 1
    assert Node.objects.filter(burst_job=job).exclude(state=S.FAILED).count() == 2


def test_no_burst_without_an_image_past_max_nodes_or_over_budget(pool, team):
    job = waiting_job(team, nodes=2)
    ask = cloud.BurstAsk(job_id=job.pk, pool_id=pool.pk, nodes=2, gpus_per_node=8, spot=True)
    bare = cloud_pool("aws-bare", image_id="")
    small = cloud_pool("aws-small", max_nodes=1)

    outcome = cloud.burst_nodes_request(
        asks=[
            cloud.BurstAsk(job_id=job.pk, pool_id=bare.pk, nodes=2, gpus_per_node=8, spot=True),
            cloud.BurstAsk(
                job_id=job.pk + 1, pool_id=small.pk, nodes=2, gpus_per_node=8, spot=True
            ),
        ]
    )
    assert outcome.node_ids == []
    assert "has no image_id" in outcome.skipped[job.pk]
    assert "max_nodes" in outcome.skipped[job.pk + 1]

    # The scheduler's apply step holds the burst against the team's budget before it asks
    # the fleet: $30 spent of $100, and 2 × 8 GPUs for an hour at $80 a p5 node-hour (no
    # spot price known: spot is priced as on-demand) would cost $160.
    from tests.apps.costs.conftest import cloud_price
    from tests.apps.costs.test_budgets import spend

    cloud_price("80", since=timezone.now() - dt.timedelta(days=1))
    spend(team, Decimal(30))
    costs.budget_set(team=team, monthly_limit=Decimal(100), by=None)
    bursts = [BurstRequest(job_id=job.pk, pool_id=pool.pk, nodes=2, spot=True)]
    applied, waits = apply.Applied(), {}
    apply._apply_bursts(bursts, now=timezone.now(), applied=applied, waits=waits)
    assert applied.burst_nodes == [] and not Node.objects.filter(burst_job=job).exists()
    assert waits[job.pk].reason == (
        "no cloud burst: 2 × 8 GPUs for 1 h on aws-test (p5.48xlarge, spot) could cost "
        "$160.00, and team alpha has $70.00 of its $100.00 budget left this month"
    )
    assert cloud.burst_nodes_request(asks=[ask]).node_ids  # the fleet itself would have


def test_a_burst_node_launches_on_spot_tagged_with_its_job_and_its_token(aws, pool, team):
    group = aws.ec2.create_security_group(GroupName=f"gpu-{uuid.uuid4().hex[:6]}", Description="t")
    fleet.pool_update(pool=pool, security_group_ids=[group["GroupId"]], by=None)
    job = waiting_job(team, nodes=1)
    scheduling_pass()
    (node,) = Node.objects.filter(burst_job=job)
    assert node.placement_group == ""  # one node: no placement group

    assert provision_node(node.pk) == S.BOOTSTRAPPING

    (instance,) = instances(aws)
    node.refresh_from_db()
    assert node.instance_id == instance["InstanceId"]
    assert node.capacity_type == "spot" and instance["InstanceLifecycle"] == "spot"
    assert node.launched_at is not None
    assert node.address == instance["PrivateIpAddress"]
    assert (node.provision_step, node.provision_percent) == ("agent", 90)
    assert tags_of(instance) == {
        "Name": node.name,
        "controlplane:id": aws.config.control_plane_id,
        "controlplane:node-uuid": str(node.uuid),
        "controlplane:team": team.slug,
        "controlplane:job": str(job.pk),
        "controlplane:pool": pool.slug,
    }
    assert [g["GroupId"] for g in instance["SecurityGroups"]] == [group["GroupId"]]
    # The user data carries the node's bootstrap token: it opens registration only.
    raw = aws.ec2.describe_instance_attribute(
        InstanceId=instance["InstanceId"], Attribute="userData"
    )["UserData"]["Value"]
    script = base64.b64decode(raw).decode()
    (line,) = [line for line in script.splitlines() if "CONTROLPLANE_NODE_TOKEN=" in line]
    (token,) = [
        word.strip("'").split("=", 1)[1]
        for word in shlex.split(line, posix=False)
        if word.strip("'").startswith("CONTROLPLANE_NODE_TOKEN=")
    ]
    assert agents.agent_identity(token).node_id == node.pk
    assert agents.agent_identity(token).bootstrap
    assert "https://cp.example.com/agent/bundle.tar.gz" in script

    # The agent registers (moto runs no user data, so the test does): READY, and the next
    # pass places the job on its burst node.
    assert register(node).state == S.READY
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED and job.pool == pool


def test_a_multi_node_job_launches_in_its_placement_group_removed_after_its_nodes(aws, pool, team):
    """moto has no placement groups: EC2's side of this test is botocore's Stubber, on the
    client the tasks use, with answers shaped like EC2's."""
    job = waiting_job(team, nodes=2)
    scheduling_pass()
    nodes = list(Node.objects.filter(burst_job=job).order_by("pk"))
    group = cloud.placement_group_for(job.pk)
    assert {n.placement_group for n in nodes} == {group}
    ours = [
        {"Name": "tag:controlplane:id", "Values": [aws.config.control_plane_id]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
    ]
    specs, answers = [], []
    with Stubber(aws.ec2) as ec2:
        for i, node in enumerate(nodes):
            spec = AwsNodeSpec(
                uuid=str(node.uuid), name=node.name, instance_type="p5.48xlarge", image_id=IMAGE
            )
            mine = [*ours, {"Name": "tag:controlplane:node-uuid", "Values": [spec.uuid]}]
            launched = reservation(spec, spot=True, placement_group=group)
            launched["Instances"][0]["InstanceId"] = f"i-0f1e2d3c4b5a6978{i}"
            running = copy.deepcopy(launched)
            running["Instances"][0]["State"] = {"Code": 16, "Name": "running"}
            ec2.add_response("describe_instances", {"Reservations": []}, {"Filters": mine})
            ec2.add_response(
                "create_placement_group",
                {
                    "PlacementGroup": {
                        "GroupName": group,
                        "Strategy": "cluster",
                        "State": "available",
                    }
                },
                {"GroupName": group, "Strategy": "cluster", "TagSpecifications": ANY},
            )
            ec2.add_response(
                "run_instances",
                launched,
                launch_params(spec, spot=True, Placement={"GroupName": group}),
            )
            ec2.add_response("describe_instances", {"Reservations": [running]}, {"Filters": mine})
            ec2.add_response("describe_instances", {"Reservations": [running]}, {"Filters": mine})
            specs.append((spec, mine))
            answers.append(running)
        for node in nodes:
            assert provision_node(node.pk) == S.BOOTSTRAPPING
            register(Node.objects.get(pk=node.pk))
        ec2.assert_no_pending_responses()

        # Idle past the pool's timeout: both are terminated, then the group is deleted.
        for (_, mine), running in zip(specs, answers, strict=True):
            instance_id = running["Instances"][0]["InstanceId"]
            ec2.add_response("describe_instances", {"Reservations": [running]}, {"Filters": mine})
            ec2.add_response(
                "terminate_instances",
                {
                    "TerminatingInstances": [
                        {
                            "InstanceId": instance_id,
                            "CurrentState": {"Code": 32, "Name": "shutting-down"},
                            "PreviousState": {"Code": 16, "Name": "running"},
                        }
                    ]
                },
                {"InstanceIds": [instance_id]},
            )
        in_group = [
            {"Name": "placement-group-name", "Values": [group]},
            {
                "Name": "instance-state-name",
                "Values": ["pending", "running", "stopping", "stopped"],
            },
        ]
        ec2.add_response("describe_instances", {"Reservations": []}, {"Filters": in_group})
        ec2.add_response("delete_placement_group", {}, {"GroupName": group})

        later = timezone.now() + dt.timedelta(seconds=pool.idle_timeout_s + 5)
        counts = cloud_sweep_run(now=later)
        ec2.assert_no_pending_responses()

    assert (counts["terminated"], counts["placement_groups_deleted"]) == (2, 1)
    assert set(Node.objects.filter(burst_job=job).values_list("state", flat=True)) == {S.TERMINATED}
    assert Node.objects.get(pk=nodes[0].pk).instance_id == "i-0f1e2d3c4b5a69780"


def test_the_pool_launches_on_demand_while_its_spot_interruption_rate_is_high(aws, pool, team):
    job = waiting_job(team, nodes=1)
    now = timezone.now()
    for _ in range(2):  # two spot nodes launched this week, one interrupted: 50% > 20%
        old = factories.make_node(
            pool=pool, provider="aws", capacity_type="spot", rack=None, gpu_count=8
        )
        Node.objects.filter(pk=old.pk).update(launched_at=now - dt.timedelta(days=1))
    Node.objects.filter(pk=old.pk).update(interrupted_at=now)
    assert agents.pool_spot_interruption_rate(pool_id=pool.pk) == 0.5
    node = burst_node(pool, job=job, spot=True)
    assert node.capacity_type == "spot"  # asked for spot...

    provision_node(node.pk)

    (instance,) = of_node(aws, node)
    assert "InstanceLifecycle" not in instance  # ...launched on-demand
    node.refresh_from_db()
    assert node.capacity_type == "on_demand"


def test_a_pool_under_its_limit_and_a_job_that_refuses_spot(aws, pool, team):
    job = waiting_job(team, nodes=1)
    spot = burst_node(pool, job=job, spot=True)
    refused = burst_node(cloud_pool("aws-other"), job=waiting_job(team, nodes=1), spot=False)

    provision_node(spot.pk)
    provision_node(refused.pk)

    assert of_node(aws, spot)[0]["InstanceLifecycle"] == "spot"
    assert "InstanceLifecycle" not in of_node(aws, refused)[0]


# --- a worker killed mid-provisioning --------------------------------------------------------


class WorkerKilled(BaseException):
    """Stands in for SIGKILL: nothing after it runs, no handler catches it."""


def test_a_worker_killed_mid_launch_then_re_driven_leaves_exactly_one_instance(
    aws, pool, team, monkeypatch
):
    node = burst_node(pool, job=waiting_job(team, nodes=1))

    def killed_after_launch(**_):  # run_instances has returned; nothing was written yet
        raise WorkerKilled

    monkeypatch.setattr(cloud, "cloud_node_launched", killed_after_launch)
    with pytest.raises(WorkerKilled):
        provision_node(node.pk)
    monkeypatch.undo()
    node.refresh_from_db()
    assert node.state == S.PROVISIONING and node.instance_id == ""
    assert len(of_node(aws, node)) == 1

    # The sweep re-drives a node stuck in PROVISIONING (broker redelivery alone may not).
    later = timezone.now() + dt.timedelta(minutes=11)
    assert cloud.cloud_nodes_stalled(now=later) == [node.pk]
    assert provision_node(node.pk) == S.BOOTSTRAPPING  # what the re-driven task runs
    assert provision_node(node.pk) == S.BOOTSTRAPPING  # and a duplicate delivery

    (instance,) = of_node(aws, node)
    node.refresh_from_db()
    assert node.instance_id == instance["InstanceId"]


def test_two_workers_on_one_node_launch_one_at_a_time(aws, pool, team):
    node = burst_node(pool, job=waiting_job(team, nodes=1))

    with single_flight(f"fleet.aws-launch:{node.uuid}", ttl_s=60) as held:
        assert held
        with pytest.raises(ProvisioningFailed) as failed:
            provision_node(node.pk)
    assert failed.value.retryable is True
    assert of_node(aws, node) == []
    assert provision_node(node.pk) == S.BOOTSTRAPPING
    assert len(of_node(aws, node)) == 1


def test_a_stalled_node_is_re_driven_through_the_broker_once_per_period(pool, team, monkeypatch):
    node = burst_node(pool, job=waiting_job(team, nodes=1))
    sent = []
    monkeypatch.setattr(app, "send_task", lambda name, args: sent.append((name, args)))
    later = timezone.now() + dt.timedelta(minutes=11)

    cloud_sweep_run(now=later)
    cloud_sweep_run(now=later)

    assert sent == [("fleet.provision", [node.pk])]


def test_a_node_not_ready_in_time_fails_then_is_terminated(aws, pool, team, settings):
    node = burst_node(pool, job=waiting_job(team, nodes=1))
    provision_node(node.pk)
    assert len(of_node(aws, node)) == 1
    requested_at = timezone.now() - dt.timedelta(seconds=settings.CLOUD_NODE_BOOT_TIMEOUT_S + 1)
    Node.objects.filter(pk=node.pk).update(created_at=requested_at)  # its agent never called

    counts = cloud_sweep_run()

    node.refresh_from_db()
    assert counts["failed"] == 1 and node.state == S.FAILED
    assert "not ready within" in node.state_reason
    assert of_node(aws, node)[0]["State"]["Name"] == "running"  # kept for ops to look at

    cloud_sweep_run(now=timezone.now() + dt.timedelta(seconds=pool.idle_timeout_s + 1))

    node.refresh_from_db()
    assert node.state == S.TERMINATED
    assert of_node(aws, node)[0]["State"]["Name"] in ("shutting-down", "terminated")


# --- scale down ----------------------------------------------------------------------------------


def test_idle_cloud_nodes_are_terminated_and_busy_ones_kept(aws, pool, team, settings):
    job = waiting_job(team, nodes=1)
    idle, got_work, holding, fresh, drained = (ready_burst_node(pool, team) for _ in range(5))
    # A spot notice drained one: out of service, it goes like an idle one.
    agents.node_spot_interruption_record(node_id=drained.pk, notice={"time": "soon"})
    # `holding` says READY but holds GPUs (an allocation the scheduler just wrote).
    Allocation.objects.create(job=job, node=holding, gpus=8, started_at=timezone.now())
    later = timezone.now() + dt.timedelta(seconds=pool.idle_timeout_s + 5)
    Node.objects.filter(pk=fresh.pk).update(state_changed_at=later)  # idle only just now

    due = cloud.cloud_nodes_to_retire(now=later)
    assert set(due) >= {idle.pk, got_work.pk, holding.pk} and fresh.pk not in due
    # Between the list and the retirement, the scheduler places work on one of them.
    fleet.nodes_work_started(node_ids=[got_work.pk])

    counts = cloud_sweep_run(now=later)

    states = dict(Node.objects.filter(pool=pool).values_list("id", "state"))
    assert states == {
        idle.pk: S.TERMINATED,
        got_work.pk: S.BUSY,
        holding.pk: S.READY,
        fresh.pk: S.READY,
        drained.pk: S.TERMINATED,
    }
    assert counts["retired"] == counts["terminated"] == 2
    for gone in (idle, drained):
        assert of_node(aws, gone)[0]["State"]["Name"] in ("shutting-down", "terminated")
    for kept in (got_work, holding, fresh):
        assert of_node(aws, kept)[0]["State"]["Name"] == "running"
    idle.refresh_from_db()
    assert idle.agent_token_digest == ""  # its token no longer opens anything
    assert "idle for 600s" in idle.events.filter(to_state=S.TERMINATING).get().reason


# --- orphans -------------------------------------------------------------------------------------


def launch_unknown(aws: AwsProvider, *, pool: str, node_uuid: str | None = None) -> str:
    """An instance with our tags that no node row stands for (a lost row, a bug, a restore)."""
    spec = AwsNodeSpec(
        uuid=node_uuid or str(uuid.uuid4()),
        name="stray",
        instance_type="p5.48xlarge",
        image_id=IMAGE,
        pool=pool,
    )
    return aws.create(spec).instance_id


def test_the_orphan_sweep_reports_or_terminates_per_the_pools_policy(
    aws, pool, team, caplog, ops_user, api_for
):
    strict = cloud_pool("aws-strict", orphans="terminate")
    known = burst_node(pool, job=waiting_job(team, nodes=1))
    provision_node(known.pk)
    reported = launch_unknown(aws, pool=pool.slug)
    terminated = launch_unknown(aws, pool=strict.slug)
    no_pool = launch_unknown(aws, pool="deleted-pool")
    # Another control plane's instance in the same account is not ours to touch.
    someone_else = dataclasses.replace(
        aws.config, control_plane_id=f"{aws.config.control_plane_id}-b"
    )
    launch_unknown(AwsProvider(someone_else), pool=strict.slug)

    with caplog.at_level(logging.WARNING, logger="apps.fleet.cloud"):
        counts = orphan_sweep_run()

    assert (counts["reported"], counts["terminated"], counts["new"]) == (2, 1, 3)
    state = {i["InstanceId"]: i["State"]["Name"] for i in instances(aws)}
    assert state[reported] == state[no_pool] == "running"
    assert state[terminated] in ("shutting-down", "terminated")
    known.refresh_from_db()
    assert state[known.instance_id] == "running"
    rows = {o.instance_id: o for o in OrphanInstance.objects.all()}
    assert set(rows) == {reported, terminated, no_pool}
    assert (rows[reported].action, rows[reported].pool) == ("reported", pool)
    assert (rows[terminated].action, rows[terminated].pool) == ("terminated", strict)
    assert (rows[no_pool].action, rows[no_pool].pool, rows[no_pool].pool_tag) == (
        "reported",
        None,
        "deleted-pool",
    )
    assert AuditEvent.objects.filter(action="orphan_instance.reported").count() == 2
    assert AuditEvent.objects.filter(action="orphan_instance.terminated").count() == 1
    assert sum(reported in r.getMessage() for r in caplog.records) == 1

    # Ops see them in the API; the next sweep notes the terminated one gone, and does not
    # report the same orphans again.
    listed = api_for(ops_user, scopes=("read",)).get("/api/v1/orphan-instances/?live=true")
    assert listed.status_code == 200 and listed.json()["count"] == 3
    again = orphan_sweep_run()
    assert (again["reported"], again["new"], again["gone"]) == (2, 0, 1)
    assert AuditEvent.objects.filter(action__startswith="orphan_instance.").count() == 3
    assert OrphanInstance.objects.get(instance_id=terminated).gone_at is not None


def test_a_node_requested_while_the_sweep_lists_is_no_orphan(aws, pool, team, monkeypatch):
    job = waiting_job(team, nodes=1)
    node_uuid = str(uuid.uuid4())
    instance_id = launch_unknown(aws, pool=pool.slug, node_uuid=node_uuid)
    listing = AwsProvider.orphan_sweep

    def listed_then_row_committed(self, known, **kwargs):
        found = listing(self, known, **kwargs)
        # The node's row committed after the sweep read the known nodes, before the
        # launch the listing saw (a row is always written before its launch).
        made = burst_node(pool, job=job)
        Node.objects.filter(pk=made.pk).update(uuid=node_uuid)
        return found

    monkeypatch.setattr(AwsProvider, "orphan_sweep", listed_then_row_committed)
    counts = orphan_sweep_run()

    assert counts["reported"] == counts["terminated"] == 0
    assert not OrphanInstance.objects.filter(instance_id=instance_id).exists()


# --- the beat ------------------------------------------------------------------------------------


def test_the_beat_runs_both_cloud_sweeps(settings):
    schedule = app.conf.beat_schedule
    assert schedule["fleet-cloud-sweep"]["task"] == "fleet.cloud_sweep"
    assert schedule["fleet-orphan-sweep"]["task"] == "fleet.orphan_sweep"
    assert schedule["fleet-cloud-sweep"]["schedule"] == float(settings.CLOUD_SWEEP_EVERY_S)
    for name in ("fleet.cloud_sweep", "fleet.orphan_sweep"):
        assert app.tasks[name].acks_late is True


def test_a_sweep_that_finds_the_lock_taken_skips():
    from workers.tasks.cloud import cloud_sweep, orphan_sweep

    with (
        single_flight("fleet.cloud_sweep", ttl_s=30),
        single_flight("fleet.orphan_sweep", ttl_s=30),
    ):
        assert "skipped" in cloud_sweep()
        assert "skipped" in orphan_sweep()
