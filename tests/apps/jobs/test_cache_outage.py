"""Redis, as the cache, gone: submissions, the Queue and job pages still answer from
PostgreSQL (slower, with warnings), and nothing is written twice or lost."""

import socket

import pytest

from apps.jobs.models import Job
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


@pytest.fixture
def redis_gone(settings):
    """Django's cache pointed at a Redis that is not there: a port nothing listens on, so
    every command is refused, as when Redis has died."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings.CACHES = {
        "default": {
            "BACKEND": "controlplane.cache.SharedClientRedisCache",
            "LOCATION": f"redis://127.0.0.1:{port}/0",
        }
    }
    from django.core.cache import cache

    with pytest.raises(Exception, match=r"(?i)connect"):
        cache.get("anything")  # the cache really is gone


def test_submissions_and_pages_answer_while_the_cache_is_gone(
    fleet_pool, quota, team, researcher, redis_gone, api_for, client
):
    api = api_for(researcher, scopes=("submit",))
    names = ["cache-gone-first", "cache-gone-second"]
    answers = [api.post("/api/v1/jobs/", command_spec(team, name=n), format="json") for n in names]
    assert [a.status_code for a in answers] == [201, 201], answers
    assert sorted(Job.objects.values_list("name", flat=True)) == names
    job = Job.objects.get(name="cache-gone-second")
    detail = api_for(researcher).get(f"/api/v1/jobs/{job.pk}/")
    assert detail.status_code == 200 and detail.json()["pending_reason"]
    assert api_for(researcher).get("/api/v1/queue/").status_code == 200
    client.force_login(researcher)
    queue = client.get("/jobs/")
    assert queue.status_code == 200 and "cache-gone-second" in queue.content.decode()


def test_a_scheduling_pass_places_jobs_while_the_cache_is_gone(
    fleet_pool, quota, team, researcher, redis_gone
):
    """The pass reads what it needs from PostgreSQL when Redis is down: it still places."""
    from apps.jobs import services
    from apps.jobs.scheduler.run import scheduling_pass

    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    scheduling_pass()
    scheduling_pass()  # a second pass adds usage since the first
    job.refresh_from_db()
    assert job.state == "admitted"
