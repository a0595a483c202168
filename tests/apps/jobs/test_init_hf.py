"""trainer.init.hf: starting weights from a Hugging Face directory, checked at submission and
passed to the trainer in run.json's init.hf."""

import json

import pytest

from apps.jobs.models import Job
from apps.jobs.runconfig import trainer_run_config
from tests.apps.jobs.conftest import trainer_spec

pytestmark = pytest.mark.django_db


def _submit(api_for, user, spec):
    return api_for(user).post("/api/v1/jobs/", spec, format="json")


def _with_init(team, path, **extra):
    spec = trainer_spec(team, **extra)
    spec["trainer"]["init"] = {"hf": path}
    return spec


def test_an_absolute_path_reaches_run_json(fleet_pool, quota, team, researcher, api_for):
    answer = _submit(api_for, researcher, _with_init(team, "/shared/models/llama-8b"))
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    config = json.loads(trainer_run_config(job, attempt=1))
    assert config["init"] == {"hf": "/shared/models/llama-8b"}
    assert config["model"]["preset"] == "8b"  # the trainer checks the shapes against it


def test_without_init_run_json_has_none(fleet_pool, quota, team, researcher, api_for):
    answer = _submit(api_for, researcher, trainer_spec(team))
    job = Job.objects.get(pk=answer.json()["id"])
    assert "init" not in json.loads(trainer_run_config(job, attempt=1))


@pytest.mark.parametrize(
    ("path", "phrase"),
    [
        ("s3://bucket/models/llama", "S3 is not read yet; stage it on a path"),
        ("models/llama", "absolute path"),
        ("/shared/../etc", "absolute path"),
    ],
)
def test_s3_and_relative_paths_are_refused(
    path, phrase, fleet_pool, quota, team, researcher, api_for
):
    answer = _submit(api_for, researcher, _with_init(team, path))
    assert answer.status_code == 400, answer.content
    assert phrase in str(answer.json()["error"]["details"]["trainer.init.hf"])
    assert not Job.objects.exists()


def test_the_model_sizes_must_be_given(fleet_pool, quota, team, researcher, api_for):
    spec = _with_init(team, "/shared/models/llama-8b")
    del spec["trainer"]["preset"]
    answer = _submit(api_for, researcher, spec)
    assert answer.status_code == 400
    assert "trainer.preset" in answer.json()["error"]["details"]
