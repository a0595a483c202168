"""Owned nodes whose provisioning was lost (a worker killed mid-bootstrap) are taken up
again by a sweep, through the real broker, once per period; a provisioning still under
way is not run twice."""

import datetime as dt

import pytest
from django.utils import timezone

from apps.fleet.models import Node, NodeState
from tests import factories
from tests.apps.fleet.test_services import walk
from tests.apps.jobs.test_scheduling_pass import _broker_messages
from workers.tasks.locks import single_flight
from workers.tasks.provisioning import provision, provisioning_redrive

pytestmark = pytest.mark.django_db

S = NodeState


def _stalled(state, *, provider="local", seconds_ago=301):
    path = (S.PROVISIONING,) if state == S.PROVISIONING else (S.PROVISIONING, S.BOOTSTRAPPING)
    address = {"address": "10.0.0.5"} if provider == "ssh" else {}
    node = walk(factories.make_node(provider=provider, **address), *path)
    since = timezone.now() - dt.timedelta(seconds=seconds_ago)
    Node.objects.filter(pk=node.pk).update(state_changed_at=since)
    return node


def test_stalled_owned_nodes_are_re_driven_through_the_broker_once_per_period(settings):
    settings.OWNED_REDRIVE_AFTER_S = 300
    _broker_messages()  # an empty queue to start from
    bootstrapping = _stalled(S.BOOTSTRAPPING)
    provisioning = _stalled(S.PROVISIONING, provider="ssh")
    _stalled(S.BOOTSTRAPPING, seconds_ago=30)  # its task may well be running still
    walk(factories.make_node(provider="local"), S.PROVISIONING, S.BOOTSTRAPPING, S.READY)

    assert provisioning_redrive() == {"redriven": 2}
    assert provisioning_redrive() == {"redriven": 0}  # once per period
    sent = sorted((task, args) for task, args, _ in _broker_messages())
    assert sent == sorted(
        [("fleet.provision", bootstrapping.pk), ("fleet.provision", provisioning.pk)]
    )


def test_a_provisioning_still_under_way_is_not_run_twice():
    node = _stalled(S.BOOTSTRAPPING)
    with single_flight(f"fleet.provision:{node.pk}", ttl_s=60):
        assert provision.run(node.pk) == "already being provisioned"
    node.refresh_from_db()
    assert node.state == S.BOOTSTRAPPING
