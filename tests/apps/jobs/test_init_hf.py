"""trainer.init.hf: starting weights from a Hugging Face directory, checked at submission and
passed to the trainer in run.json's init.hf."""

import json

import pytest

from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, Run
from apps.jobs.runconfig import trainer_run_config
from apps.jobs.scheduler.run import scheduling_pass
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
        ("s3://Bad_Bucket/models/llama", "s3://bucket/prefix/"),
        ("s3://bucket/models/../llama", "s3://bucket/prefix/"),
        ("models/llama", "absolute path"),
        ("/shared/../etc", "absolute path"),
    ],
)
def test_unplain_s3_and_relative_paths_are_refused(
    path, phrase, fleet_pool, quota, team, researcher, api_for
):
    answer = _submit(api_for, researcher, _with_init(team, path))
    assert answer.status_code == 400, answer.content
    assert phrase in str(answer.json()["error"]["details"]["trainer.init.hf"])
    assert not Job.objects.exists()


def test_an_s3_checkpoint_is_staged_into_the_teams_cache_and_run_json_reads_the_copy(
    settings, fleet_pool, quota, team, researcher, api_for
):
    settings.DATASET_CACHE_DIR = "/var/cache/datasets"
    settings.AWS_ENDPOINT_URL = "http://127.0.0.1:9000"
    spec = _with_init(
        team, "s3://models/llama-8b", preset="tiny", nodes=1, layout={"dp_shard": 8}, seq_len=256
    )
    answer = _submit(api_for, researcher, spec)
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    files = {f["path"]: f["content"] for f in run.plan["files"]}
    stage = json.loads(files["stage.json"])
    (weights,) = stage["hf"]
    assert stage["datasets"] == []
    assert weights["uri"] == "s3://models/llama-8b/"
    assert weights["dest"].startswith(f"/var/cache/datasets/{team.slug}/hf-")
    # The trainer reads the node's copy, which the stage makes before torchrun starts, in a
    # directory of the team's (the agent makes it its group's).
    assert json.loads(files["run.json"])["init"] == {"hf": weights["dest"]}
    assert run.plan["argv"][:3] == ["python3", "-m", "workers.trainer.stage"]
    assert run.plan["team_dirs"] == [weights["dest"]]
    assert run.plan["env"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"


def test_the_model_sizes_must_be_given(fleet_pool, quota, team, researcher, api_for):
    spec = _with_init(team, "/shared/models/llama-8b")
    del spec["trainer"]["preset"]
    answer = _submit(api_for, researcher, spec)
    assert answer.status_code == 400
    assert "trainer.preset" in answer.json()["error"]["details"]
