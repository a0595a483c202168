"""/healthz answers for the database and the broker; /metrics speaks Prometheus."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import factories
from tests.apps.fleet.test_services import ready_node

pytestmark = pytest.mark.django_db


def test_healthz_checks_the_database_and_the_broker(client):
    response = client.get("/healthz")
    assert response.status_code == 200, response.content
    assert response.json() == {"status": "ok", "database": "ok", "broker": "ok"}


def test_healthz_says_503_when_the_broker_is_unreachable(client, settings):
    from controlplane.celery import app

    original = app.conf.broker_url
    app.conf.broker_url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    try:
        response = client.get("/healthz")
    finally:
        app.conf.broker_url = original
    assert response.status_code == 503
    assert response.json()["broker"].startswith("error")


def _samples(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_counts_nodes_by_state_gpus_by_health_and_requests(client, ops_user):
    client.force_login(ops_user)
    ready_node()
    ready_node()
    factories.make_node()
    client.get("/healthz")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples = _samples(response.content.decode())
    assert samples[("controlplane_nodes", (("state", "ready"),))] == 2
    assert samples[("controlplane_nodes", (("state", "requested"),))] == 1
    assert ("controlplane_gpus", (("health", "healthy"),)) in samples
    healthz = (
        "controlplane_http_requests_total",
        (("method", "GET"), ("route", "healthz"), ("status", "200")),
    )
    assert samples[healthz] >= 1


def test_metrics_can_require_a_token(client, settings):
    settings.METRICS_TOKEN = "scrape-secret"
    assert client.get("/metrics").status_code == 401
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret")
    assert ok.status_code == 200


def test_without_a_token_metrics_answer_only_ops_and_superusers(
    client, settings, researcher, ops_user, superuser
):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 401
    client.force_login(researcher)
    assert client.get("/metrics").status_code == 403
    for user in (ops_user, superuser):
        client.force_login(user)
        assert client.get("/metrics").status_code == 200
