"""The whole path on real parts: the live server, local nodes whose agents are real
processes, the scheduler's pass and the dispatch service called as their tasks would."""

import contextlib
import time

import pytest

from apps.accounts import services as accounts
from apps.fleet.models import Node
from tests import factories
from workers.tasks.provisioning import provision_node, terminate_node


@pytest.fixture
def agents_reach(live_server, settings, tmp_path):
    """Agents call the live server; local nodes live under a scratch folder."""
    settings.CONTROLPLANE_URL = live_server.url
    settings.VAR_DIR = tmp_path
    settings.AGENT_HEARTBEAT_S = 1
    settings.NODE_MIN_FREE_DISK_GB = 0
    return live_server


def wait_for(what, predicate, timeout_s: float = 60.0, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


@pytest.fixture
def local_nodes(agents_reach):
    """`local_nodes(pool, count, gpus)`: local nodes brought up to READY by their real agents."""
    made = []

    def make(pool, count: int = 1, gpus: int = 2):
        nodes = []
        for _ in range(count):
            node = factories.make_node(pool=pool, provider="local", gpu_count=gpus)
            provision_node(node.pk)
            made.append(node.pk)
            nodes.append(node)
        for node in nodes:
            wait_for(
                f"{node.name} to register",
                lambda node=node: Node.objects.get(pk=node.pk).state == "ready",
            )
        return nodes

    yield make
    for node_id in made:
        with contextlib.suppress(Exception):  # the test may have taken it down itself
            terminate_node(node_id)


@pytest.fixture
def e2e_team(db):
    team = factories.make_team(slug="e2e")
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    return team
