"""Malformed requests (controlplane/badrequests.py, controlplane/parsers.py, the agent
endpoints): a 400 or 413 in the API's error shape on /api/ paths and a plain 400 on pages,
never a 500 nor Django's HTML page for an API client."""

import json

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from apps.fleet import agents, services
from apps.fleet.api.agent import heartbeat_fast_path
from apps.fleet.models import NodeState
from tests import factories
from tests.shortroads import call, django_and_road

pytestmark = pytest.mark.django_db

TOO_BIG = b'{"name": "' + b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1) + b'"}'
DEEP = b"[" * 5000


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"] == "application/json"
    return response.json()["error"]


@pytest.fixture
def node_token():
    node = factories.make_node()
    for state in (NodeState.PROVISIONING, NodeState.BOOTSTRAPPING, NodeState.READY):
        node = services.node_transition(node=node, to=state, reason="t", by=None)
    return agents.node_agent_token_issue(node=node)


@pytest.fixture
def agent(node_token):
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {node_token}")
    return client


@pytest.fixture
def api(researcher, api_for):
    client = api_for(researcher, scopes=("admin",))
    client.raise_request_exception = False
    return client


# --- query parameters PostgreSQL cannot take ----------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "/jobs/?state=a%00b",
        "/jobs/?team=%00",
        "/jobs/queue.csv?team=a%00",
        "/jobs/queue.csv?state=%00",
        "/jobs/history/?team=%00",
        "/jobs/history.csv?team=%00",
        "/jobs/history.csv?%00=x",
        "/costs/?team_id=1%00",
    ],
)
def test_a_nul_in_a_pages_query_is_a_plain_400(client, viewer, url):
    client.raise_request_exception = False
    client.force_login(viewer)
    response = client.get(url)
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/plain")
    assert "Null characters" in response.content.decode()


@pytest.mark.parametrize(
    "url", ["/api/v1/jobs/?state=a%00", "/api/v1/queue/?team=%00", "/api/v1/jobs/?ordering=%00"]
)
def test_a_nul_in_an_api_query_is_a_400_in_the_error_shape(api, url):
    error = error_of(api.get(url), 400)
    assert error["code"] == "invalid"
    assert list(error["details"].values()) == [["Null characters are not allowed."]]


def test_a_query_of_plain_text_goes_on(client, viewer):
    client.force_login(viewer)
    assert client.get("/jobs/?state=pending&team=alpha").status_code == 200


# --- Django's request limits on API paths -------------------------------------------------------


def test_a_body_past_djangos_limit_is_a_413_in_the_error_shape(api, agent):
    error = error_of(api.generic("POST", "/api/v1/jobs/", TOO_BIG, "application/json"), 413)
    assert error["code"] == "too_large"
    for path in ("/api/v1/agent/heartbeat", "/api/v1/agent/register"):
        error = error_of(agent.generic("POST", path, TOO_BIG, "application/json"), 413)
        assert error["code"] == "too_large"


def test_too_many_query_parameters_is_a_413_in_the_error_shape(api):
    query = "&".join(f"p{i}=1" for i in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
    error = error_of(api.get(f"/api/v1/jobs/?{query}"), 413)
    assert error["code"] == "too_large"


# --- JSON nested past Python's recursion limit --------------------------------------------------


def test_deeply_nested_json_is_a_parse_error_on_every_api_endpoint(api, team):
    for path in ("/api/v1/jobs/", "/api/v1/webhooks/"):
        error = error_of(api.generic("POST", path, DEEP, "application/json"), 400)
        assert error["code"] == "parse_error", path


def test_deeply_nested_json_is_a_parse_error_for_agents_on_both_roads(agent, node_token):
    for path in ("/api/v1/agent/heartbeat", "/api/v1/agent/register", "/api/v1/agent/events"):
        error = error_of(agent.generic("POST", path, DEEP, "application/json"), 400)
        assert error["code"] == "parse_error", path
    with django_and_road(heartbeat_fast_path) as (django_app, fast):
        quick = call(fast, token=node_token, body=DEEP)
        slow = call(django_app, token=node_token, body=DEEP)
    assert quick == slow
    assert quick[0] == 400 and json.loads(quick[2])["error"]["code"] == "parse_error"
