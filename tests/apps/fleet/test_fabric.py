"""Fabric health: heartbeats' error counters, their rates, and degraded links and nodes."""

import time

import pytest
from django.core.cache import cache

from apps.accounts.models import AuditEvent
from apps.fleet import agents, fabric
from apps.fleet.models import Node, NodeEvent
from tests.apps.fleet.test_agents import _registered, report

pytestmark = pytest.mark.django_db


def beat(node, client, links: dict, *, at: float) -> None:
    """A heartbeat carrying `links`, landed through the API as if it had arrived at `at`,
    then flushed."""
    answer = client.post("/api/v1/agent/heartbeat", {**report(8), "fabric": links}, format="json")
    assert answer.status_code == 200
    key = agents._heartbeat_key(node.pk)
    cache.set(key, (at, cache.get(key)[1]))
    assert agents.nodes_heartbeats_flush()["written"] == 1


def links_of(node) -> dict:
    return Node.objects.get(pk=node.pk).fabric["links"]


@pytest.fixture
def t0():
    return time.time() + 60  # after the registration's heartbeat


def test_rates_are_per_minute_over_the_time_between_two_readings(t0):
    node, client = _registered()
    beat(node, client, {"mlx5_0/1": {"symbol_error": 100, "link_downed": 0}}, at=t0)
    first = links_of(node)["mlx5_0/1"]
    assert first["counters"] == {"symbol_error": 100, "link_downed": 0}
    assert first["rates"] == {}  # one reading: no rate yet
    beat(node, client, {"mlx5_0/1": {"symbol_error": 106, "link_downed": 0}}, at=t0 + 120)
    second = links_of(node)["mlx5_0/1"]
    assert second["counters"] == {"symbol_error": 106, "link_downed": 0}
    assert second["rates"] == {"symbol_error": 3.0, "link_downed": 0.0}  # 6 in 2 minutes
    assert Node.objects.get(pk=node.pk).fabric_degraded_since is None


def test_a_counter_that_goes_down_restarts_its_baseline(t0):
    node, client = _registered()
    beat(node, client, {"mlx5_0/1": {"symbol_error": 5000}}, at=t0)
    beat(node, client, {"mlx5_0/1": {"symbol_error": 4}}, at=t0 + 60)  # a driver reload
    assert links_of(node)["mlx5_0/1"]["rates"] == {}
    beat(node, client, {"mlx5_0/1": {"symbol_error": 10}}, at=t0 + 90)
    assert links_of(node)["mlx5_0/1"]["rates"] == {"symbol_error": 12.0}  # 6 in 30 s
    assert Node.objects.get(pk=node.pk).fabric_degraded_since is not None  # 12 > 10


def test_a_rate_over_its_limit_marks_the_link_and_node_until_it_stays_low(settings, t0):
    settings.FABRIC_CLEAR_AFTER_S = 600
    node, client = _registered()
    quiet = {"symbol_error": 0}
    beat(node, client, {"mlx5_0/1": quiet, "mlx5_1/1": quiet}, at=t0)
    beat(node, client, {"mlx5_0/1": {"symbol_error": 30}, "mlx5_1/1": quiet}, at=t0 + 60)
    marked = Node.objects.get(pk=node.pk)
    assert marked.fabric_degraded_since.timestamp() == pytest.approx(t0 + 60)
    assert marked.fabric_degraded_reason == "mlx5_0/1: symbol_error 30/min over 10/min"
    assert links_of(node)["mlx5_0/1"]["degraded_since"] == pytest.approx(t0 + 60)
    assert links_of(node)["mlx5_1/1"]["degraded_since"] is None
    event = NodeEvent.objects.filter(node=node).first()
    assert event.reason.startswith("fabric degraded: mlx5_0/1: symbol_error 30/min")
    assert event.from_state == event.to_state == marked.state  # not a state change
    assert AuditEvent.objects.filter(action="node.fabric_degraded").count() == 1
    # Back within its limit, but not yet for ten minutes: still degraded, not marked twice.
    steady = {"mlx5_0/1": {"symbol_error": 30}, "mlx5_1/1": quiet}
    beat(node, client, steady, at=t0 + 300)
    assert Node.objects.get(pk=node.pk).fabric_degraded_since is not None
    assert AuditEvent.objects.filter(action="node.fabric_degraded").count() == 1
    beat(node, client, steady, at=t0 + 60 + 600)
    healthy = Node.objects.get(pk=node.pk)
    assert healthy.fabric_degraded_since is None and healthy.fabric_degraded_reason == ""
    assert links_of(node)["mlx5_0/1"]["degraded_since"] is None
    assert NodeEvent.objects.filter(node=node).first().reason.startswith("fabric healthy again")
    assert AuditEvent.objects.filter(action="node.fabric_healthy").count() == 1


def test_one_link_going_down_marks_the_node(t0):
    node, client = _registered()
    beat(node, client, {"rdmap0s31/1": {"rx_drops": 0}, "mlx5_0/1": {"link_downed": 3}}, at=t0)
    beat(node, client, {"rdmap0s31/1": {"rx_drops": 5}, "mlx5_0/1": {"link_downed": 4}}, at=t0 + 15)
    marked = Node.objects.get(pk=node.pk)
    assert marked.fabric_degraded_reason == "mlx5_0/1: link_downed 4/min over 0/min"
    assert links_of(node)["rdmap0s31/1"]["rates"] == {"rx_drops": 20.0}  # within 100/min


def test_what_an_agent_sends_is_checked():
    assert fabric.fabric_compact(["mlx5_0/1"]) == {}
    assert fabric.fabric_compact(
        {
            "mlx5_0/1": {
                "symbol_error": 3,
                "link_downed": -1,
                "port_rcv_errors": "7",
                "rx_drops": True,
                "x" * 65: 1,
                "huge": 2**64,
            },
            "bad link name!": {"symbol_error": 1},
            "mlx5_1/1": "garbage",
        }
    ) == {"mlx5_0/1": {"symbol_error": 3}}


def test_a_heartbeat_with_fabric_counters_still_writes_nothing_until_the_flush(
    django_assert_num_queries,
):
    _node, client = _registered()
    with django_assert_num_queries(0):
        client.post(
            "/api/v1/agent/heartbeat",
            {**report(8), "fabric": {"mlx5_0/1": {"symbol_error": 1}}},
            format="json",
        )


def test_the_node_and_fleet_pages_show_links_rates_and_the_degraded_mark(client, viewer, t0):
    node, agent = _registered()
    beat(node, agent, {"mlx5_0/1": {"symbol_error": 0}, "rdmap0s31/1": {"rx_drops": 9}}, at=t0)
    client.force_login(viewer)
    page = client.get(f"/fleet/nodes/{node.pk}/").content.decode()
    assert 'data-link="mlx5_0/1" data-counter="symbol_error"' in page
    assert 'data-link="rdmap0s31/1" data-counter="rx_drops"' in page
    assert "Fabric degraded" not in page
    assert "Fabric degraded" not in client.get("/fleet/").content.decode()
    beat(
        node, agent, {"mlx5_0/1": {"symbol_error": 45}, "rdmap0s31/1": {"rx_drops": 9}}, at=t0 + 60
    )
    live = client.get(f"/fleet/nodes/{node.pk}/live/").content.decode()
    row = live.split('data-counter="symbol_error" class="fabric-over">')[1].split("</tr>")[0]
    assert row.count(">45<") == 2 and ">10<" in row  # count 45, 45/min, limit 10
    assert "symbol_error 45/min over 10/min" in live
    fleet = client.get("/fleet/").content.decode()
    row = fleet.split(f'data-node="{node.name}"')[1].split("</tr>")[0]
    assert "Fabric degraded" in row
