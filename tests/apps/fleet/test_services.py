"""The node state machine, drains, host keys and the heartbeat sweep."""

import base64
import datetime as dt

import pytest
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.django import TestCase as HypothesisTestCase

from apps.accounts.models import AuditEvent
from apps.fleet import services
from apps.fleet.hostkeys import fingerprint
from apps.fleet.models import Node, NodeEvent, NodeState
from controlplane.errors import ApplicationError
from tests import factories

pytestmark = pytest.mark.django_db
S = NodeState


def ed25519_key(seed: int = 1) -> str:
    blob = b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + bytes([seed]) * 32
    return "ssh-ed25519 " + base64.b64encode(blob).decode()


def walk(node, *states):
    for state in states:
        node = services.node_transition(node=node, to=state, reason="test", by=None)
    return node


def ready_node(**extra):
    return walk(factories.make_node(**extra), S.PROVISIONING, S.BOOTSTRAPPING, S.READY)


def test_a_new_node_is_requested_with_an_event():
    node = factories.make_node()
    assert node.state == S.REQUESTED
    assert NodeEvent.objects.get(node=node).to_state == S.REQUESTED


def test_an_allowed_move_writes_an_event_and_an_audit_row(ops_user):
    node = factories.make_node()
    moved = services.node_transition(node=node, to=S.PROVISIONING, reason="start", by=ops_user)
    assert moved.state == S.PROVISIONING
    event = NodeEvent.objects.filter(node=node).first()
    assert (event.from_state, event.to_state, event.actor) == (
        S.REQUESTED,
        S.PROVISIONING,
        ops_user,
    )
    audit = AuditEvent.objects.get(action="node.provisioning")
    assert audit.before["state"] == S.REQUESTED and audit.after["state"] == S.PROVISIONING


def test_a_forbidden_move_changes_nothing():
    node = factories.make_node()
    with pytest.raises(ApplicationError) as caught:
        services.node_transition(node=node, to=S.BUSY, reason="skip ahead", by=None)
    assert caught.value.status == 409
    node.refresh_from_db()
    assert node.state == S.REQUESTED
    assert NodeEvent.objects.filter(node=node).count() == 1


def test_drain_an_idle_node_ends_drained_and_undrain_returns_it(ops_user):
    node = ready_node()
    drained = services.node_drain(node=node, reason="swap PSU", by=ops_user)
    assert drained.state == S.DRAINED
    states = list(
        NodeEvent.objects.filter(node=node).order_by("id").values_list("to_state", flat=True)
    )
    assert states[-2:] == [S.DRAINING, S.DRAINED]
    assert services.node_undrain(node=drained, by=ops_user).state == S.READY


def test_drain_a_busy_node_waits_in_draining(ops_user):
    node = walk(ready_node(), S.BUSY)
    assert services.node_drain(node=node, reason="maintenance", by=ops_user).state == S.DRAINING


def test_undraining_a_node_that_still_runs_jobs_makes_it_busy(ops_user):
    node = services.node_drain(node=walk(ready_node(), S.BUSY), reason="fans", by=ops_user)
    assert services.node_undrain(node=node, by=ops_user).state == S.BUSY


def test_a_down_node_is_drained_at_once(ops_user):
    node = walk(ready_node(), S.SUSPECT, S.DOWN)
    drained = services.node_drain(node=node, reason="send it back", by=ops_user)
    assert drained.state == S.DRAINED and drained.state_reason == "send it back"


def test_only_ops_drain(researcher):
    node = ready_node()
    with pytest.raises(ApplicationError) as caught:
        services.node_drain(node=node, reason="mine now", by=researcher)
    assert caught.value.status == 403
    node.refresh_from_db()
    assert node.state == S.READY


def test_host_key_waits_for_ops_and_a_wrong_fingerprint_pins_nothing(ops_user):
    node = walk(factories.make_node(provider="ssh", address="10.0.0.5"), S.PROVISIONING)
    key = ed25519_key(7)
    node = services.node_host_key_offer(node=node, offered_key=key)
    assert node.state == S.AWAITING_HOST_KEY and node.host_key == ""
    with pytest.raises(ApplicationError) as caught:
        services.node_host_key_accept(node=node, fingerprint="SHA256:wrong", by=ops_user)
    assert caught.value.code == "fingerprint_mismatch"
    node.refresh_from_db()
    assert node.state == S.AWAITING_HOST_KEY and node.host_key == ""
    expected = fingerprint(base64.b64decode(key.split()[1]))
    node = services.node_host_key_accept(node=node, fingerprint=expected, by=ops_user)
    assert node.state == S.BOOTSTRAPPING
    assert node.host_key == key and node.host_key_fingerprint == expected
    assert node.offered_host_key == ""


def test_a_pinned_key_is_not_overwritten_by_an_update(ops_user):
    node = factories.make_node(provider="ssh", address="10.0.0.6", host_key=ed25519_key(1))
    with pytest.raises(ApplicationError) as caught:
        services.node_update(node=node, host_key=ed25519_key(2), by=ops_user)
    assert caught.value.status == 409
    node.refresh_from_db()
    assert node.host_key == ed25519_key(1)


def test_a_malformed_host_key_is_refused(ops_user):
    with pytest.raises(ApplicationError) as caught:
        factories.make_node(provider="ssh", address="10.0.0.7", host_key="ssh-ed25519 !!!")
    assert "host_key" in caught.value.details
    assert not Node.objects.filter(address="10.0.0.7").exists()


# --- heartbeats -----------------------------------------------------------------------


def test_sweep_marks_silent_nodes_suspect_and_leaves_never_heard_nodes_alone(settings):
    settings.NODE_SUSPECT_AFTER_S = 60
    now = timezone.now()
    silent = ready_node()
    fresh = ready_node()
    never = ready_node()
    Node.objects.filter(pk=silent.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=90))
    Node.objects.filter(pk=fresh.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=10))
    counts = services.nodes_heartbeat_sweep(now=now)
    assert counts == {"suspect": 1, "down": 0}
    states = dict(Node.objects.values_list("pk", "state"))
    assert states[silent.pk] == S.SUSPECT
    assert states[fresh.pk] == S.READY
    assert states[never.pk] == S.READY
    assert Node.objects.get(pk=silent.pk).suspect_from == S.READY
    assert AuditEvent.objects.filter(action="node.suspect", object_id=str(silent.pk)).exists()


def test_a_suspect_node_returns_to_busy_when_heartbeats_resume(settings):
    node = walk(ready_node(), S.BUSY)
    Node.objects.filter(pk=node.pk).update(
        last_heartbeat_at=timezone.now() - dt.timedelta(seconds=settings.NODE_SUSPECT_AFTER_S + 5)
    )
    services.nodes_heartbeat_sweep()
    assert Node.objects.get(pk=node.pk).state == S.SUSPECT
    assert services.node_heartbeat_record(node=node).state == S.BUSY


def test_only_a_long_silence_makes_a_node_down(settings):
    settings.NODE_SUSPECT_AFTER_S = 60
    settings.NODE_DOWN_AFTER_S = 600
    now = timezone.now()
    node = ready_node()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=120))
    services.nodes_heartbeat_sweep(now=now)
    services.nodes_heartbeat_sweep(now=now + dt.timedelta(seconds=30))
    assert Node.objects.get(pk=node.pk).state == S.SUSPECT  # a blip is not a death
    services.nodes_heartbeat_sweep(now=now + dt.timedelta(seconds=600))
    assert Node.objects.get(pk=node.pk).state == S.DOWN


def test_a_draining_node_that_goes_silent_goes_suspect_then_down(settings, ops_user):
    settings.NODE_SUSPECT_AFTER_S = 60
    settings.NODE_DOWN_AFTER_S = 600
    now = timezone.now()
    node = services.node_drain(node=walk(ready_node(), S.BUSY), reason="fans", by=ops_user)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=90))
    assert services.nodes_heartbeat_sweep(now=now) == {"suspect": 1, "down": 0}
    node.refresh_from_db()
    assert (node.state, node.suspect_from) == (S.SUSPECT, S.DRAINING)
    # Heard from again, it goes on draining; silent for good, it is DOWN (and its jobs
    # are requeued like any lost node's).
    assert services.node_heartbeat_record(node=node, at=now).state == S.DRAINING
    services.nodes_heartbeat_sweep(now=now + dt.timedelta(seconds=90))
    services.nodes_heartbeat_sweep(now=now + dt.timedelta(seconds=700))
    assert Node.objects.get(pk=node.pk).state == S.DOWN
    moves = list(
        NodeEvent.objects.filter(node=node).order_by("id").values_list("from_state", "to_state")
    )
    assert moves[-2:] == [(S.DRAINING, S.SUSPECT), (S.SUSPECT, S.DOWN)]


def test_the_sweep_is_a_fixed_number_of_queries(settings, django_assert_max_num_queries):
    now = timezone.now()
    for _ in range(30):
        node = ready_node()
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(hours=1))
    with django_assert_max_num_queries(12):
        counts = services.nodes_heartbeat_sweep(now=now)
    assert counts["suspect"] == 30


class TestStateMachineProperties(HypothesisTestCase):
    """Any sequence of requested moves leaves a node in a known state with a true history."""

    @given(st.lists(st.sampled_from(S.values), max_size=25))
    def test_any_sequence_of_moves(self, targets):
        node = factories.make_node()
        accepted = [S.REQUESTED]
        for target in targets:
            current = Node.objects.get(pk=node.pk).state
            allowed = target in services.NODE_TRANSITIONS[current]
            try:
                services.node_transition(node=node, to=target, reason="prop", by=None)
            except ApplicationError:
                assert not allowed
            else:
                assert allowed
                accepted.append(target)
        history = list(
            NodeEvent.objects.filter(node=node).order_by("id").values_list("to_state", flat=True)
        )
        assert history == accepted
        assert Node.objects.get(pk=node.pk).state == accepted[-1]
