"""Answers checked against the OpenAPI schema the way schemathesis checks them: the nulls
and URLs its fuzzing found outside the schema (a job not yet placed, a checkpoint on
shared storage, an instance type's source)."""

import json
import string

import jsonschema_rs
import pytest
import requests
import schemathesis
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st

from apps.fleet.models import InstanceType
from apps.jobs.models import Job
from tests import factories
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
    checkpoint = factories.make_checkpoint(job=Job.objects.get(pk=job_id), location="/c/10")
    copy = checkpoint.copies.get()
    detail = conforms(
        schema, "/api/v1/checkpoints/{id}/", api.get(f"/api/v1/checkpoints/{checkpoint.pk}/")
    )
    assert detail["node"] is None and detail["copies"][0]["node"] is None
    conforms(schema, "/api/v1/checkpoints/", api.get("/api/v1/checkpoints/"))
    answer = api.get(f"/api/v1/checkpoint-copies/{copy.pk}/")
    assert conforms(schema, "/api/v1/checkpoint-copies/{id}/", answer)["node"] is None


@pytest.mark.django_db
def test_a_jobs_rank_environments_match_the_schema(
    schema, fleet_pool, quota, team, researcher, api_for
):
    from tests.apps.jobs.test_rank_environments import RENDERED, dispatched_job, env_line, relay

    job = dispatched_job(team, researcher, nodes=1)
    api = api_for(researcher, scopes=("read",))
    reported_none = conforms(schema, "/api/v1/jobs/{id}/", api.get(f"/api/v1/jobs/{job.pk}/"))
    assert reported_none["rank_environments"]["ranks"] == []
    run = job.runs.get()
    odd = {k: v for k, v in RENDERED.items() if k != "NCCL_DEBUG"} | {
        "NCCL_ALGO": "Ring",
        "NCCL_X": "",
    }
    relay(run, [env_line(0, odd), env_line(1, RENDERED)])
    detail = conforms(schema, "/api/v1/jobs/{id}/", api.get(f"/api/v1/jobs/{job.pk}/"))
    ranks = detail["rank_environments"]["ranks"]
    assert [r["matches"] for r in ranks] == [False, True]
    assert {None} <= {d["rendered"] for d in ranks[0]["differences"]}
    assert {None} <= {d["got"] for d in ranks[0]["differences"]}


# --- an instance type's source: an http(s) URL, as the schema's `format: uri` says --------

INSTANCE_TYPE = {
    "name": "x1.test",
    "gpu_type": "H100",
    "gpu_count": 8,
    "gpu_memory_gib": 80,
    "vcpus": 96,
    "memory_gib": 1024,
    "network_gbps": 400,
}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "source",
    [
        "not a url",
        "ftp://example.com/p5",
        "https://example.com/p5/ü",
        "http://例子.com/",
        "https://example.com/a<b",
        "https://example.com/%zz",
        "https://example.com/p5#a#b",
        "https://user:pa{ss@example.com/",
    ],
)
def test_an_instance_type_source_that_is_no_http_url_is_refused(source, ops_user, api_for):
    answer = api_for(ops_user).post(
        "/api/v1/instance-types/", {**INSTANCE_TYPE, "source": source}, format="json"
    )
    assert answer.status_code == 400, answer.content
    assert list(answer.json()["error"]["details"]) == ["source"]
    assert not InstanceType.objects.filter(name="x1.test").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "source", ["", "https://aws.amazon.com/ec2/instance-types/p5/", "http://10.0.0.1:8080/a?b=1#c"]
)
def test_an_instance_type_source_matches_the_schema(source, schema, ops_user, api_for):
    api = api_for(ops_user)
    answer = api.post("/api/v1/instance-types/", {**INSTANCE_TYPE, "source": source}, format="json")
    assert conforms(schema, "/api/v1/instance-types/", answer)["source"] == source
    patched = api.patch(f"/api/v1/instance-types/{answer.json()['id']}/", {"source": source})
    conforms(schema, "/api/v1/instance-types/{id}/", patched)


URI = jsonschema_rs.Draft4Validator({"type": "string", "format": "uri"}, validate_formats=True)


URLISH = st.one_of(st.sampled_from(string.printable), st.characters(exclude_categories=["Cs"]))


@given(st.text(alphabet=URLISH, max_size=30))
def test_every_source_accepted_is_a_uri(tail):
    from django.core.exceptions import ValidationError

    from apps.fleet.models.catalogue import validate_http_url

    for source in (f"https://example.com/{tail}", f"http://{tail}", tail):
        try:
            validate_http_url(source)
        except ValidationError:
            continue
        assert URI.is_valid(source), source
