"""The fleet's side of node agents: tokens, registration, batched heartbeats, health drains."""

import datetime as dt
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from apps.fleet import agents, services
from apps.fleet.models import Gpu, Node, NodeEvent, NodeState
from tests import factories

pytestmark = pytest.mark.django_db
S = NodeState
GIB = 1024**3


def walk(node, *states):
    for state in states:
        node = services.node_transition(node=node, to=state, reason="test", by=None)
    return node


def bootstrapping_node(**extra):
    return walk(factories.make_node(**extra), S.PROVISIONING, S.BOOTSTRAPPING)


def report(gpus: int = 8, *, source="cpu-slots", disk_gb=500, **gpu_fields) -> dict:
    return {
        "version": "1.0.0",
        "hostname": "n1",
        "nccl_version": "2.21.5",
        "disk_free_bytes": disk_gb * GIB,
        "metrics": {
            "source": source,
            "message": "",
            "gpus": [
                {
                    "index": i,
                    "uuid": f"GPU-{uuid.uuid4()}",
                    "name": "NVIDIA H100 80GB HBM3",
                    "utilization": 50.0,
                    "memory_used_mib": 1000,
                    "memory_total_mib": 81559,
                    "power_w": 400.0,
                    "temperature_c": 60.0,
                    "ecc_errors": 0,
                    **gpu_fields,
                }
                for i in range(gpus)
            ],
        },
    }


def agent_client(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


# --- tokens -----------------------------------------------------------------------------------


def test_a_node_token_is_stored_hashed_and_a_new_one_retires_the_old(
    django_capture_on_commit_callbacks,
):
    node = bootstrapping_node()
    first = agents.node_agent_token_issue(node=node)
    assert first.startswith("cpn_")
    stored = Node.objects.get(pk=node.pk).agent_token_digest
    assert stored and first not in stored
    assert agents.agent_identity(first).node_id == node.pk
    assert agents.agent_identity(first).node_id == node.pk  # now from the cache
    with django_capture_on_commit_callbacks(execute=True):
        second = agents.node_agent_token_issue(node=node)
    assert agents.agent_identity(first) is None
    assert agents.agent_identity(second).node_id == node.pk
    assert agents.agent_identity("cp_an-api-token") is None


def test_agent_endpoints_need_a_node_token(researcher, api_for):
    client = api_for(researcher)  # an API token is not a node token
    response = client.post("/api/v1/agent/heartbeat", {}, format="json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"
    assert APIClient().post("/api/v1/agent/register", {}, format="json").status_code == 401


def test_a_body_that_is_not_a_json_object_is_a_400():
    node = walk(bootstrapping_node(), S.READY)
    client = agent_client(agents.node_agent_token_issue(node=node))
    answer = client.post("/api/v1/agent/heartbeat", "[1, 2]", content_type="application/json")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid"
    answer = client.post("/api/v1/agent/heartbeat", "{nope", content_type="application/json")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "parse_error"


def cloud_node_fields() -> dict:
    p5 = factories.instance_type("p5.48xlarge")
    slug = factories.unique("aws")
    pool = services.pool_create(
        by=None,
        name=slug,
        slug=slug,
        kind="cloud",
        gpu_type="H100",
        region="us-east-1",
        instance_types=[p5],
    )
    return {
        "pool": pool,
        "provider": "aws",
        "capacity_type": "spot",
        "gpu_count": 8,
        "instance_type": p5,
    }


def test_a_cloud_nodes_bootstrap_token_only_registers_and_is_traded_for_its_own(
    django_capture_on_commit_callbacks,
):
    """The user data's token is readable by anything on the instance (the metadata
    service): it opens registration only, and is retired once the node's own is used."""
    node = bootstrapping_node(**cloud_node_fields())
    bootstrap = agents.node_bootstrap_token(node=node)
    assert agents.node_bootstrap_token(node=node) == bootstrap  # a re-driven launch: the same
    stored = Node.objects.get(pk=node.pk)
    assert bootstrap not in str(stored.bootstrap_token_ciphertext)  # encrypted at rest
    other = agents.node_bootstrap_token(node=bootstrapping_node(**cloud_node_fields()))
    assert other != bootstrap  # drawn at random, not derived from anything public
    old = agent_client(bootstrap)
    assert old.post("/api/v1/agent/heartbeat", {}, format="json").status_code == 401
    assert old.get("/api/v1/agent/runs/").status_code == 401
    body = {**report(8), "isolation": {"mode": "user"}}
    answer = old.post("/api/v1/agent/register", body, format="json")
    assert answer.status_code == 200, answer.content
    own = answer.json()["token"]
    assert own.startswith("cpn_") and own != bootstrap
    assert Node.objects.get(pk=node.pk).state == S.READY
    # Until the node's own token is used, the bootstrap one may register again (the
    # answer may have been lost); once it is, the bootstrap token opens nothing.
    new = agent_client(own)
    with django_capture_on_commit_callbacks(execute=True):
        beat = new.post("/api/v1/agent/heartbeat", {"seq": 1}, format="json")
    assert beat.status_code == 200
    assert old.post("/api/v1/agent/register", body, format="json").status_code == 401
    assert agents.agent_identity(bootstrap) is None
    retired = Node.objects.get(pk=node.pk)
    assert retired.bootstrap_token_digest == "" and bytes(retired.bootstrap_token_ciphertext) == b""
    # A launch after registration gets a token that opens nothing.
    assert agents.agent_identity(agents.node_bootstrap_token(node=node)) is None


@pytest.mark.parametrize("provider", ["ssh", "aws"])
def test_an_owned_or_cloud_node_whose_agent_cannot_isolate_jobs_fails(provider):
    fields = (
        cloud_node_fields()
        if provider == "aws"
        else {"provider": "ssh", "address": "10.0.0.9", "gpu_count": 8}
    )
    node = bootstrapping_node(**fields)
    client = agent_client(agents.node_agent_token_issue(node=node))
    why = "the agent runs as uid 1000 without CAP_SETUID"
    body = {**report(8), "isolation": {"mode": "none", "reason": why}}
    assert client.post("/api/v1/agent/register", body, format="json").status_code == 200
    node.refresh_from_db()
    assert node.state == S.FAILED and node.job_isolation == "none"
    assert f"jobs cannot run as their own users: {why}" in node.state_reason


def test_a_local_node_says_whether_its_jobs_run_as_their_own_users():
    for mode in ("user", "none"):
        node = bootstrapping_node(gpu_count=4)
        client = agent_client(agents.node_agent_token_issue(node=node))
        body = {**report(4), "isolation": {"mode": mode, "reason": "not root"}}
        assert client.post("/api/v1/agent/register", body, format="json").status_code == 200
        node.refresh_from_db()
        assert (node.state, node.job_isolation) == (S.READY, mode)  # development: it may run


# --- registration -------------------------------------------------------------------------------


def test_registration_makes_a_healthy_bootstrapping_node_ready_with_its_gpus():
    node = bootstrapping_node(gpu_count=4)
    client = agent_client(agents.node_agent_token_issue(node=node))
    answer = client.post("/api/v1/agent/register", report(4), format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["problems"] == []
    node.refresh_from_db()
    assert node.state == S.READY
    assert node.agent_version == "1.0.0" and node.nccl_version == "2.21.5"
    assert sorted(Gpu.objects.filter(node=node).values_list("index", flat=True)) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (report(7), "7 GPUs found, 8 expected"),
        (report(8, ecc_errors=3), "uncorrected ECC errors"),
        (report(8, temperature_c=97.0), "above 90 °C"),
        (report(8, disk_gb=2), "GiB free for checkpoints"),
        (
            {**report(0), "metrics": {"source": "none", "message": "no nvidia-smi", "gpus": []}},
            "no nvidia-smi",
        ),
    ],
)
def test_a_node_that_fails_a_check_at_bootstrap_fails_and_says_why(body, why):
    node = bootstrapping_node(gpu_count=8)
    client = agent_client(agents.node_agent_token_issue(node=node))
    assert client.post("/api/v1/agent/register", body, format="json").status_code == 200
    node.refresh_from_db()
    assert node.state == S.FAILED
    assert why in node.state_reason


# --- heartbeats -------------------------------------------------------------------------------


def _registered(**extra) -> tuple[Node, APIClient]:
    node = bootstrapping_node(**extra)
    client = agent_client(agents.node_agent_token_issue(node=node))
    client.post("/api/v1/agent/register", report(node.gpu_count), format="json")
    node.refresh_from_db()
    return node, client


def test_heartbeats_land_in_the_cache_and_are_written_in_one_batch(django_assert_max_num_queries):
    fleet = [_registered() for _ in range(5)]
    for node, client in fleet:
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=None)
        with CaptureQueriesContext(connection) as queries:
            answer = client.post("/api/v1/agent/heartbeat", report(8, power_w=500.0), format="json")
        assert answer.status_code == 200
        # Only the cache (a table under the embedded defaults, Redis in production): no node row.
        assert not [q for q in queries if "fleet_" in q["sql"]]
    assert not Node.objects.filter(last_heartbeat_at__isnull=False).exists()  # not yet written
    with django_assert_max_num_queries(12):
        counts = agents.nodes_heartbeats_flush()
    assert counts["written"] == 5
    node = Node.objects.get(pk=fleet[0][0].pk)
    assert node.last_heartbeat_at is not None and node.power_w == 8 * 500
    gpu = Gpu.objects.get(node=node, index=3)
    assert gpu.power_w == 500.0 and gpu.utilization_pct == 50.0 and gpu.temperature_c == 60.0
    assert agents.nodes_heartbeats_flush()["written"] == 0  # nothing new


def test_a_suspect_node_heard_again_returns_to_the_state_it_left(settings):
    node, client = _registered()
    node = walk(node, S.BUSY)
    stale = timezone.now() - dt.timedelta(seconds=settings.NODE_SUSPECT_AFTER_S + 5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=stale)
    services.nodes_heartbeat_sweep()
    assert Node.objects.get(pk=node.pk).state == S.SUSPECT
    client.post("/api/v1/agent/heartbeat", report(8), format="json")
    assert agents.nodes_heartbeats_flush()["resumed"] == 1
    assert Node.objects.get(pk=node.pk).state == S.BUSY
    assert NodeEvent.objects.filter(
        node=node, to_state=S.BUSY, reason="heartbeats resumed"
    ).exists()


def test_failing_nodes_are_drained_but_never_more_than_a_fifth_of_a_pool():
    pool = factories.make_owned_pool()
    fleet = [_registered(pool=pool) for _ in range(10)]
    for _, client in fleet:  # every node overheats at once (a cooling fault)
        client.post("/api/v1/agent/heartbeat", report(8, temperature_c=99.0), format="json")
    counts = agents.nodes_heartbeats_flush()
    assert counts["drained"] == 2
    states = list(Node.objects.filter(pool=pool).values_list("state", flat=True))
    assert states.count(S.DRAINED) == 2 and states.count(S.READY) == 8
    drained = Node.objects.filter(pool=pool, state=S.DRAINED).first()
    assert "99 °C" in drained.state_reason


@pytest.mark.parametrize(
    ("version", "shipped", "older"),
    [
        ("1.0.0", "1.0.0", False),
        ("0.9.9", "1.0.0", True),
        ("1.10.0", "1.9.0", False),
        ("", "1.0.0", True),
        ("dev", "1.0.0", True),
        ("1.0", "1.0.1", True),
    ],
)
def test_which_agents_are_older_than_the_one_shipped(version, shipped, older):
    assert agents.version_older(version, shipped) is older


def test_an_old_agent_is_told_and_an_upgrade_is_asked_for(
    settings, django_capture_on_commit_callbacks
):
    settings.AGENT_VERSION = "9.0.0"
    node = bootstrapping_node(gpu_count=8)
    client = agent_client(agents.node_agent_token_issue(node=node))
    with django_capture_on_commit_callbacks() as sent:
        answer = client.post("/api/v1/agent/register", report(8), format="json").json()
    assert answer["upgrade"] is True and answer["latest_version"] == "9.0.0"
    assert any(getattr(c, "__name__", "") == "send" for c in sent)


def _down(node: Node, *, silent_s: int) -> Node:
    node = walk(node, S.SUSPECT, S.DOWN)
    Node.objects.filter(pk=node.pk).update(
        last_heartbeat_at=timezone.now() - dt.timedelta(seconds=silent_s)
    )
    return node


def _moves(node: Node) -> list[tuple[str, str, str]]:
    return list(
        NodeEvent.objects.filter(node=node)
        .order_by("id")
        .values_list("from_state", "to_state", "reason")
    )


def test_a_down_node_whose_agent_registers_again_is_checked_and_returns_to_service():
    node, client = _registered()
    node = _down(node, silent_s=900)
    answer = client.post("/api/v1/agent/register", report(8), format="json")
    assert answer.status_code == 200
    assert Node.objects.get(pk=node.pk).state == S.READY
    (back, ready) = _moves(node)[-2:]
    assert back[:2] == (S.DOWN, S.BOOTSTRAPPING) and back[2].startswith("agent back after 9")
    assert ready == (S.BOOTSTRAPPING, S.READY, "health checks passed")


def test_a_node_drained_before_it_went_down_comes_back_drained():
    node, client = _registered()
    node = walk(node, S.DRAINING)
    node = _down(node, silent_s=900)
    assert Node.objects.get(pk=node.pk).suspect_from == S.DRAINING
    client.post("/api/v1/agent/register", report(8), format="json")
    node.refresh_from_db()
    assert node.state == S.DRAINED, node.state_reason
    assert _moves(node)[-1][2].startswith("health checks passed; drained before it went down")


def test_a_down_node_back_with_failing_checks_waits_for_ops():
    node, client = _registered()
    node = _down(node, silent_s=900)
    client.post("/api/v1/agent/register", report(6), format="json")
    node.refresh_from_db()
    assert node.state == S.FAILED
    assert node.state_reason == "health checks failed on return: 6 GPUs found, 8 expected"


def test_a_down_node_heard_from_again_without_registering_returns_to_service():
    node, client = _registered()
    node = _down(node, silent_s=900)
    client.post("/api/v1/agent/heartbeat", report(8), format="json")
    assert agents.nodes_heartbeats_flush()["back"] == 1
    assert Node.objects.get(pk=node.pk).state == S.READY
    assert _moves(node)[-2][2].startswith("agent back after 9")
