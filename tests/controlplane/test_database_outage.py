"""PostgreSQL unreachable (restarting, failing over): every request answers 503 with
Retry-After, never 500, and a submit retried with its Idempotency-Key once the database is
back makes the job exactly once."""

import socket

import pytest
from django.db import connection
from django.test import Client

from apps.jobs.models import Job
from tests.apps.jobs.conftest import command_spec, fleet_pool, quota  # noqa: F401 (fixtures)
from tests.conftest import token_client

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _dead_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def database_gone():
    """Until the `with` ends, the connection points at a port nothing listens on."""
    if connection.vendor != "postgresql":
        pytest.skip("the outage is PostgreSQL's")

    class Outage:
        def __enter__(self):
            connection.close()
            self.port = connection.settings_dict["PORT"]
            connection.settings_dict["PORT"] = str(_dead_port())

        def __exit__(self, *exc):
            connection.close()
            connection.settings_dict["PORT"] = self.port

    return Outage()


@pytest.mark.usefixtures("fleet_pool", "quota")
def test_a_database_outage_is_a_503_to_retry_and_the_retry_makes_the_job_once(
    team, researcher, database_gone
):
    api = token_client(researcher, scopes=("submit",))
    api.raise_request_exception = False  # answered as a client would see it
    page = Client(raise_request_exception=False)
    page.force_login(researcher)
    spec = command_spec(team)
    with database_gone:
        answer = api.post("/api/v1/jobs/", spec, format="json", HTTP_IDEMPOTENCY_KEY="ci-77")
        shown = page.get("/jobs/")
    assert answer.status_code == 503, answer.content
    assert answer["Retry-After"] == "5"
    assert answer.json()["error"]["code"] == "unavailable"
    assert shown.status_code == 503 and shown["Retry-After"] == "5"
    assert Job.objects.count() == 0

    first = api.post("/api/v1/jobs/", spec, format="json", HTTP_IDEMPOTENCY_KEY="ci-77")
    again = api.post("/api/v1/jobs/", spec, format="json", HTTP_IDEMPOTENCY_KEY="ci-77")
    assert (first.status_code, again.status_code) == (201, 200)
    assert Job.objects.count() == 1
