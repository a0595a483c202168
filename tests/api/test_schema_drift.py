"""Answers checked against the OpenAPI schema the way schemathesis checks them: the nulls
its fuzzing found outside the schema (a job not yet placed, a checkpoint on shared storage)."""

import json

import pytest
import requests
import schemathesis
from django.test import Client
from django.utils import timezone

from apps.checkpoints.models import Checkpoint, CheckpointCopy
from tests.apps.jobs import conftest as jobs_fixtures

fleet_pool = jobs_fixtures.fleet_pool
quota = jobs_fixtures.quota


@pytest.fixture(scope="module")
def schema(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        raw = Client().get("/api/schema/", {"format": "json"}).content
    return schemathesis.openapi.from_dict(json.loads(raw))


def conforms(schema, template: str, answer) -> dict:
    """Raise unless the answer is one the schema documents; return its body."""
    request = answer.wsgi_request
    response = schemathesis.Response(
        status_code=answer.status_code,
        headers={name: [value] for name, value in answer.items()},
        content=answer.content,
        request=requests.Request(request.method, request.build_absolute_uri()).prepare(),
        elapsed=0.0,
        verify=False,
    )
    schema[template][request.method].validate_response(response)
    return answer.json()


@pytest.mark.django_db
def test_a_job_not_yet_placed_matches_the_schema(
    schema, fleet_pool, quota, team, researcher, api_for
):
    api = api_for(researcher, scopes=("submit",))
    spec = jobs_fixtures.trainer_spec(
        team, preset="tiny", nodes=1, gpus_per_node=8, layout={"dp_shard": 8}, seq_len=256
    )
    submitted = conforms(schema, "/api/v1/jobs/", api.post("/api/v1/jobs/", spec, format="json"))
    assert submitted["state"] == "pending" and submitted["pool"] is None
    detail = api.get(f"/api/v1/jobs/{submitted['id']}/")
    assert conforms(schema, "/api/v1/jobs/{id}/", detail)["pool"] is None
    (row,) = conforms(schema, "/api/v1/jobs/", api.get("/api/v1/jobs/"))["results"]
    assert row["pool"] is None


@pytest.mark.django_db
def test_a_job_whose_submitter_is_gone_matches_the_schema(
    schema, fleet_pool, quota, team, researcher, viewer, api_for
):
    spec = jobs_fixtures.trainer_spec(
        team, preset="tiny", nodes=1, gpus_per_node=8, layout={"dp_shard": 8}, seq_len=256
    )
    job_id = api_for(researcher).post("/api/v1/jobs/", spec, format="json").json()["id"]
    researcher.delete()
    answer = api_for(viewer, scopes=("read",)).get(f"/api/v1/jobs/{job_id}/")
    assert conforms(schema, "/api/v1/jobs/{id}/", answer)["submitted_by"] is None


@pytest.mark.django_db
def test_a_checkpoint_on_shared_storage_matches_the_schema(
    schema, fleet_pool, quota, team, researcher, api_for
):
    spec = jobs_fixtures.trainer_spec(
        team, preset="tiny", nodes=1, gpus_per_node=8, layout={"dp_shard": 8}, seq_len=256
    )
    api = api_for(researcher, scopes=("read",))
    job_id = api_for(researcher).post("/api/v1/jobs/", spec, format="json").json()["id"]
    checkpoint = Checkpoint.objects.create(
        job_id=job_id,
        team=team,
        attempt=1,
        step=10,
        manifest_sha256="0" * 64,
        committed_at=timezone.now(),
    )
    copy = CheckpointCopy.objects.create(checkpoint=checkpoint, kind="shared", location="/c/10")
    detail = conforms(
        schema, "/api/v1/checkpoints/{id}/", api.get(f"/api/v1/checkpoints/{checkpoint.pk}/")
    )
    assert detail["node"] is None and detail["copies"][0]["node"] is None
    conforms(schema, "/api/v1/checkpoints/", api.get("/api/v1/checkpoints/"))
    answer = api.get(f"/api/v1/checkpoint-copies/{copy.pk}/")
    assert conforms(schema, "/api/v1/checkpoint-copies/{id}/", answer)["node"] is None
