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


@pytest.mark.postgres
def test_metrics_export_gpu_telemetry_the_queue_and_spend_by_team(
    client, ops_user, team, researcher, django_assert_max_num_queries
):
    import datetime as dt

    from django.utils import timezone

    from apps.accounts import services as accounts
    from apps.fleet.models import Gpu, Node
    from apps.jobs import services as jobs
    from apps.jobs.models import Job
    from tests.apps.costs.conftest import (
        Allocations,
        at,
        cloud_node,
        cloud_pool,
        cloud_price,
        meter,
    )
    from tests.apps.jobs.conftest import command_spec

    # GPU readings, as the heartbeat flush writes them; a gone node's are not exported.
    node = ready_node(name="gpu-box")
    Gpu.objects.bulk_create(
        [
            Gpu(
                node=node,
                index=i,
                utilization_pct=90.0 + i,
                memory_used_mib=1024,
                temperature_c=70.0,
                power_w=650.0,
                reported_at=timezone.now(),
            )
            for i in range(2)
        ]
    )
    gone = factories.make_node(name="gone-box")
    Gpu.objects.create(node=gone, index=0, utilization_pct=1.0, reported_at=timezone.now())
    Node.objects.filter(pk=gone.pk).update(state="terminated")
    # The queue: two normal jobs (one held) and an urgent one, queued an hour ago.
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    for priority in ("normal", "normal", "urgent"):
        spec = command_spec(team, priority=priority)
        jobs.job_submit(team=team, spec=spec, submitted_by=researcher)
    held = Job.objects.filter(priority_class="normal").first()
    jobs.job_hold(job=held, by=researcher)
    Job.objects.filter(priority_class="urgent").update(
        queued_at=timezone.now() - dt.timedelta(hours=1)
    )
    # Spend, metered for real: the team's job held the $2/h node for 10 h of 24.
    pool = cloud_pool("aws-metrics")
    cloud_price("2", since=at(-48))
    box = cloud_node(pool)
    meter(Allocations([(box.pk, 1, team.pk, 8, at(0), at(10))]), until=at(24))

    client.force_login(ops_user)
    with django_assert_max_num_queries(12):
        response = client.get("/metrics")
    samples = _samples(response.content.decode())

    gpu1 = (("gpu", "1"), ("node", "gpu-box"))
    assert samples[("controlplane_gpu_utilization_percent", gpu1)] == 91.0
    assert samples[("controlplane_gpu_memory_used_bytes", gpu1)] == 1024 * 1024 * 1024
    assert samples[("controlplane_gpu_temperature_celsius", gpu1)] == 70.0
    assert samples[("controlplane_gpu_power_watts", gpu1)] == 650.0
    assert ("controlplane_gpu_utilization_percent", (("gpu", "0"), ("node", "gone-box"))) not in (
        samples
    )

    assert samples[("controlplane_queue_jobs", (("priority", "normal"), ("state", "pending")))] == 1
    assert samples[("controlplane_queue_jobs", (("priority", "normal"), ("state", "held")))] == 1
    assert samples[("controlplane_queue_jobs", (("priority", "urgent"), ("state", "pending")))] == 1
    urgent_wait = samples[("controlplane_queue_longest_wait_seconds", (("priority", "urgent"),))]
    assert 3600 <= urgent_wait < 3700
    assert samples[("controlplane_queue_longest_wait_seconds", (("priority", "low"),))] == 0

    team_spend = samples[("controlplane_team_spend_dollars_total", (("team", team.slug),))]
    idle = samples[("controlplane_team_spend_dollars_total", (("team", "(idle)"),))]
    assert team_spend == pytest.approx(20.0)
    assert team_spend + idle == pytest.approx(48.0)
    # The metrics that were there before are still there.
    assert samples[("controlplane_nodes", (("state", "ready"),))] >= 1
