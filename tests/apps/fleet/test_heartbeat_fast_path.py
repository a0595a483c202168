"""The heartbeats' short road (controlplane/wsgi.py): the view's own answer, or it hands over."""

import json

import pytest
from django.core.cache import cache
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.fleet import agents, services
from apps.fleet.api.agent import heartbeat_fast_path
from apps.fleet.models import Node, NodeState
from controlplane.observability import REQUESTS
from tests import factories
from tests.shortroads import call, django_and_road

pytestmark = pytest.mark.django_db
S = NodeState


def ready_node():
    node = factories.make_node()
    for state in (S.PROVISIONING, S.BOOTSTRAPPING, S.READY):
        node = services.node_transition(node=node, to=state, reason="t", by=None)
    return node


@pytest.fixture
def apps():
    with django_and_road(heartbeat_fast_path) as both:
        yield both


def test_a_valid_heartbeat_is_landed_without_a_query_and_answered_as_the_view_does(apps):
    django_app, fast = apps
    node = ready_node()
    token = agents.node_agent_token_issue(node=node)
    slow = call(django_app, token=token, body=b'{"seq": 1}')
    before = REQUESTS.labels("POST", "agent-heartbeat", "200")._value.get()
    with CaptureQueriesContext(connection) as queries:
        quick = call(fast, token=token, body=b'{"seq": 2}')
    assert quick == slow
    assert quick[0] == 200 and json.loads(quick[2]) == {"ok": True}
    assert REQUESTS.labels("POST", "agent-heartbeat", "200")._value.get() == before + 1
    assert not [q for q in queries if "fleet_" in q["sql"]]  # the token came from the cache
    assert cache.get(agents._heartbeat_key(node.pk))[1]["seq"] == 2
    assert agents.nodes_heartbeats_flush()["written"] == 1
    assert Node.objects.get(pk=node.pk).last_heartbeat_at is not None


VALID = object()  # stands for the node's own token


@pytest.mark.parametrize(
    ("token", "request_parts", "status", "code"),
    [
        (None, {}, 401, "not_authenticated"),
        ("cpn_nope", {}, 401, "not_authenticated"),
        ("cp_an-api-token", {}, 401, "not_authenticated"),
        (VALID, {"body": b"[1, 2]"}, 400, "invalid"),
        (VALID, {"body": b"{nope"}, 400, "parse_error"),
        (VALID, {"body": b"\xff\xfe"}, 400, "parse_error"),
        (VALID, {"method": "GET", "body": b""}, 405, "method_not_allowed"),
    ],
)
def test_what_is_not_a_plain_heartbeat_gets_the_views_answer(
    apps, token, request_parts, status, code
):
    django_app, fast = apps
    node = ready_node()
    issued = agents.node_agent_token_issue(node=node)
    parts = {"token": issued if token is VALID else token, **request_parts}
    quick, slow = call(fast, **parts), call(django_app, **parts)
    assert quick == slow
    assert quick[0] == status and json.loads(quick[2])["error"]["code"] == code
    if status == 401:
        assert quick[1]["WWW-Authenticate"] == 'Bearer realm="agent"'
    assert cache.get(agents._heartbeat_key(node.pk)) is None


def test_a_host_django_refuses_is_refused(apps):
    django_app, fast = apps
    token = agents.node_agent_token_issue(node=ready_node())
    assert call(fast, token=token, host="evil.example")[0] == 400
    assert call(fast, token=token, host="evil.example") == call(
        django_app, token=token, host="evil.example"
    )


def test_a_revoked_token_stops_at_once(apps, django_capture_on_commit_callbacks):
    _, fast = apps
    node = ready_node()
    token = agents.node_agent_token_issue(node=node)
    assert call(fast, token=token)[0] == 200
    with django_capture_on_commit_callbacks(execute=True):
        agents.node_agent_token_revoke(node=node)
    assert call(fast, token=token)[0] == 401


def test_an_empty_body_is_an_empty_heartbeat_on_both_roads(apps):
    django_app, fast = apps
    token = agents.node_agent_token_issue(node=ready_node())
    assert call(fast, token=token, body=b"") == call(django_app, token=token, body=b"")


def test_other_paths_go_to_django(apps):
    _, fast = apps
    assert call(fast, path="/api/v1/agent/register")[0] == 401
    assert call(fast, path="/healthz", method="GET", body=b"")[0] in (200, 503)


def test_a_cache_failure_while_landing_goes_to_django(apps, monkeypatch):
    _, fast = apps
    token = agents.node_agent_token_issue(node=ready_node())
    calls = []
    real = agents.node_heartbeat_land

    def flaky(**kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("cache down")
        return real(**kwargs)

    monkeypatch.setattr(agents, "node_heartbeat_land", flaky)
    assert call(fast, token=token)[0] == 200  # the view landed it on the second try
    assert len(calls) == 2
