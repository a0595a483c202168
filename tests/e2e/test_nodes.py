"""Nodes on real parts: an old agent is replaced by the one the control plane ships."""

import pytest

from apps.fleet.models import Node
from tests import factories
from tests.e2e.conftest import wait_for
from tests.e2e.test_faults import _agent_pid
from workers.tasks.provisioning import agent_upgrade_node

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_an_idle_node_with_an_older_agent_gets_the_shipped_one(local_nodes, settings):
    pool = factories.make_owned_pool(slug="e2e-upgrade")
    (node,) = local_nodes(pool, count=1, gpus=2)
    before = _agent_pid(node)
    Node.objects.filter(pk=node.pk).update(agent_version="0.1.0")  # as an old agent reports
    assert agent_upgrade_node(node.pk) == "upgraded"
    assert _agent_pid(node) != before
    wait_for(
        "the new agent to register",
        lambda: Node.objects.get(pk=node.pk).agent_version == settings.AGENT_VERSION,
    )
    assert Node.objects.get(pk=node.pk).state == "ready"
    assert agent_upgrade_node(node.pk) == "current"
