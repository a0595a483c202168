"""Datasets: registered from an index (services and API), named in job specs, staged by the
run plan (run.json's mixture and stage.json) and followed on the Job page."""

import hashlib
import json

import pytest

from apps.jobs import datasets, services
from apps.jobs.dispatch import job_dispatch, run_logs_append
from apps.jobs.models import Dataset, Job, JobState, Run
from apps.jobs.scheduler.run import scheduling_pass
from controlplane.errors import ApplicationError
from tests.apps.jobs.conftest import trainer_spec

pytestmark = pytest.mark.django_db

SHA = hashlib.sha256(b"x").hexdigest()


def index(vocab_size=256, **extra) -> dict:
    """An index shaped like prepare's: shards, a validation split, the tokenizer."""
    shard = {
        "file": "shard-00000.bin",
        "tokens": 1000,
        "documents": 10,
        "bytes": 2000,
        "sha256": SHA,
    }
    return {
        "format": 1,
        "tokenizer": {"name": "llama-3", "sha256": SHA, "vocab_size": vocab_size},
        "shards": [shard, {**shard, "file": "shard-00001.bin", "tokens": 500}],
        "validation": {**shard, "file": "validation.bin"},
        **extra,
    }


def register(team, name="wiki-en", uri="s3://data-bucket/wiki/", **kwargs) -> Dataset:
    return datasets.dataset_register(
        team=team, name=name, uri=uri, index=kwargs.pop("index", index()), by=None, **kwargs
    )


# --- services -------------------------------------------------------------------------------


def test_registering_keeps_the_index_and_sums_the_shards(team, researcher):
    dataset = datasets.dataset_register(
        team=team, name="wiki-en", uri="s3://data-bucket/wiki", index=index(), by=researcher
    )
    assert dataset.uri == "s3://data-bucket/wiki/"
    assert (dataset.shards, dataset.tokens, dataset.documents, dataset.bytes) == (2, 1500, 20, 4000)
    assert (dataset.tokenizer_name, dataset.tokenizer_sha256, dataset.vocab_size) == (
        "llama-3",
        SHA,
        256,
    )
    assert dataset.index == index() and len(dataset.index_sha256) == 64
    # Totals the index states itself win over the sums.
    stated = register(team, name="books", index=index(tokens=7, documents=3))
    assert (stated.tokens, stated.documents) == (7, 3)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"shards": []}, "index"),
        ({"shards": [{"file": "a.bin", "sha256": "nothex"}]}, "index.shards.0.sha256"),
        ({"shards": [{"file": "a.bin", "sha256": SHA, "tokens": -1}]}, "index.shards.0.tokens"),
        ({"shards": [{"file": "a.bin", "sha256": SHA, "tokens": 1.5}]}, "index.shards.0.tokens"),
        ({"shards": [{"file": "../a.bin", "sha256": SHA}]}, "index.shards.0.file"),
        ({"tokenizer": {"name": "x"}}, "index.tokenizer.vocab_size"),
    ],
)
def test_an_index_that_does_not_hold_is_a_400_naming_the_field(team, bad, field):
    body = {**index(), "validation": None, **bad}
    with pytest.raises(ApplicationError) as refused:
        register(team, index=body)
    assert list(refused.value.details) == [field]
    assert not Dataset.objects.exists()


@pytest.mark.parametrize(
    "uri", ["relative/path", "/data/../etc", "s3://B/x", "s3://bucket/../x", "ftp://x"]
)
def test_a_uri_that_is_neither_s3_nor_an_absolute_path_is_refused(team, uri):
    with pytest.raises(ApplicationError) as refused:
        register(team, uri=uri)
    assert list(refused.value.details) == ["uri"]


def test_a_name_is_unique_per_team(team, other_team):
    register(team)
    register(other_team)
    with pytest.raises(ApplicationError) as refused:
        register(team)
    assert list(refused.value.details) == ["name"]


def test_a_viewer_cannot_register_and_delete_waits_for_live_jobs(
    fleet_pool, quota, team, researcher, viewer
):
    with pytest.raises(ApplicationError) as refused:
        datasets.dataset_register(team=team, name="x", uri="/shared/x", index=index(), by=viewer)
    assert refused.value.status == 403
    dataset = register(team)
    job = submit_mixture(team, researcher)
    with pytest.raises(ApplicationError) as busy:
        datasets.dataset_delete(dataset=dataset, by=researcher)
    assert busy.value.status == 409 and busy.value.details == {"jobs": [job.pk]}
    services.job_cancel(job=job, by=researcher, reason="done")
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED
    datasets.dataset_delete(dataset=dataset, by=researcher)
    assert not Dataset.objects.filter(name="wiki-en").exists()


# --- the API --------------------------------------------------------------------------------


def test_the_api_registers_lists_by_team_and_deletes(
    api_for, team, other_team, researcher, ops_user, viewer
):
    register(other_team, name="theirs")
    client = api_for(researcher, scopes=("submit",))
    body = {"team": team.pk, "name": "wiki-en", "uri": "/shared/data/wiki", "index": index()}
    made = client.post("/api/v1/datasets/", body, format="json")
    assert made.status_code == 201, made.content
    assert made.json()["tokens"] == 1500 and made.json()["team_slug"] == team.slug
    bad = client.post(
        "/api/v1/datasets/", {**body, "name": "b", "index": {"shards": []}}, format="json"
    )
    assert bad.status_code == 400 and list(bad.json()["error"]["details"]) == ["index"]
    other = client.post("/api/v1/datasets/", {**body, "team": other_team.pk}, format="json")
    assert other.status_code == 400 and list(other.json()["error"]["details"]) == ["team"]
    seen = {
        row["name"]
        for row in api_for(viewer, scopes=("read",)).get("/api/v1/datasets/").json()["results"]
    }
    assert seen == {"wiki-en"}
    everything = api_for(ops_user, scopes=("read",)).get("/api/v1/datasets/").json()["results"]
    assert {row["name"] for row in everything} == {"wiki-en", "theirs"}
    csv = api_for(viewer, scopes=("read",)).get("/api/v1/datasets/?format=csv")
    lines = csv.content.decode().splitlines()
    assert lines[0].startswith("id,team,name,uri") and len(lines) == 2 and "wiki-en" in lines[1]
    gone = client.delete(f"/api/v1/datasets/{made.json()['id']}/")
    assert gone.status_code == 204 and not Dataset.objects.filter(team=team).exists()


def test_the_datasets_page_and_its_csv(client, team, viewer, other_team):
    register(team)
    register(other_team, name="theirs")
    client.force_login(viewer)
    page = client.get("/jobs/datasets/").content.decode()
    assert "wiki-en" in page and "theirs" not in page and "s3://data-bucket/wiki/" in page
    csv = client.get("/jobs/datasets.csv").content.decode().splitlines()
    assert len(csv) == 2 and "wiki-en" in csv[1]


# --- job specs ------------------------------------------------------------------------------


def mixture_spec(team, mixture):
    spec = trainer_spec(team, preset="tiny", nodes=1, layout={"dp_shard": 8}, seq_len=256)
    del spec["trainer"]["dataset"]
    spec["trainer"]["data"] = {"mixture": mixture}
    return spec


def submit_mixture(team, user, mixture=None):
    mixture = mixture or [
        {"dataset": "wiki-en", "weight": 0.7},
        {"dataset": "books", "weight": 0.3},
    ]
    if not Dataset.objects.filter(team=team, name="books").exists():
        register(team, name="books", uri="/shared/data/books")
    job, _ = services.job_submit(team=team, spec=mixture_spec(team, mixture), submitted_by=user)
    return job


def test_a_mixture_names_datasets_of_the_jobs_team(
    api_for, fleet_pool, quota, team, other_team, researcher
):
    register(team)
    register(other_team, name="theirs")
    client = api_for(researcher, scopes=("submit",))
    mixture = [{"dataset": "wiki-en", "weight": 1}, {"dataset": "theirs", "weight": 1}]
    answer = client.post("/api/v1/jobs/", mixture_spec(team, mixture), format="json")
    assert answer.status_code == 400
    assert list(answer.json()["error"]["details"]) == ["trainer.data.mixture.1.dataset"]
    zero = client.post(
        "/api/v1/jobs/", mixture_spec(team, [{"dataset": "wiki-en", "weight": 0}]), format="json"
    )
    assert zero.status_code == 400 and "trainer" in zero.json()["error"]["details"]
    both = mixture_spec(team, [{"dataset": "wiki-en", "weight": 1}])
    both["trainer"]["dataset"] = "synthetic"
    assert client.post("/api/v1/jobs/", both, format="json").status_code == 400
    ok = client.post(
        "/api/v1/jobs/", mixture_spec(team, [{"dataset": "wiki-en", "weight": 2}]), format="json"
    )
    assert ok.status_code == 201, ok.content


def test_a_dataset_with_more_token_ids_than_the_model_is_refused(
    fleet_pool, quota, team, researcher
):
    register(team, index=index(vocab_size=50_000))  # the tiny preset has 256
    with pytest.raises(ApplicationError) as refused:
        services.job_submit(
            team=team,
            spec=mixture_spec(team, [{"dataset": "wiki-en", "weight": 1}]),
            submitted_by=researcher,
        )
    assert "50000" in refused.value.details["trainer.data.mixture.0.dataset"][0]


# --- dispatch -------------------------------------------------------------------------------


def test_dispatch_stages_s3_datasets_before_torchrun(settings, fleet_pool, quota, team, researcher):
    settings.DATASET_CACHE_DIR = "/var/cache/datasets"
    settings.AWS_ENDPOINT_URL = "http://127.0.0.1:9000"
    wiki = register(team)
    job = submit_mixture(team, researcher)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    files = {f["path"]: f["content"] for f in run.plan["files"]}
    dest = f"/var/cache/datasets/{team.slug}/{wiki.pk}-{wiki.index_sha256[:16]}"
    assert json.loads(files["run.json"])["data"] == {
        "mixture": [
            {"path": dest, "weight": 0.7, "name": "wiki-en"},
            {"path": "/shared/data/books", "weight": 0.3, "name": "books"},
        ],
        "seq_len": 256,
    }
    assert json.loads(files["stage.json"]) == {
        "datasets": [
            {"name": "wiki-en", "uri": "s3://data-bucket/wiki/", "dest": dest},
            {"name": "books", "uri": "/shared/data/books", "dest": ""},
        ],
        "hf": [],
    }
    argv = run.plan["argv"]
    assert argv[:8] == [
        "python3",
        "-m",
        "workers.trainer.stage",
        "--plan",
        "stage.json",
        "--then",
        "--",
        "python3",
    ]
    assert argv[8:10] == ["-m", "torch.distributed.run"] and argv[-2:] == ["--config", "run.json"]
    # The node's copy is the team's (the agent makes it its group's), not this job's own.
    assert run.plan["team"] == team.pk and run.plan["team_dirs"] == [dest]
    assert dest not in run.plan["owned_dirs"]
    assert run.plan["env"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"


def test_a_job_without_datasets_runs_torchrun_directly(fleet_pool, quota, team, researcher):
    spec = trainer_spec(team, preset="tiny", nodes=1, layout={"dp_shard": 8}, seq_len=256)
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    assert run.plan["argv"][:3] == ["python3", "-m", "torch.distributed.run"]
    assert [f["path"] for f in run.plan["files"]] == ["run.json"]


def test_stage_lines_show_on_the_job_page(client, fleet_pool, quota, team, researcher):
    register(team)
    job = submit_mixture(team, researcher)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    progress = {
        "event": "stage",
        "dataset": "wiki-en",
        "files_done": 3,
        "files": 12,
        "bytes_done": 3_200_000_000,
        "bytes": 12_000_000_000,
        "reused_bytes": 1_100_000_000,
    }
    lines = [
        {"seq": 1, "text": json.dumps({**progress, "bytes_done": 1})},
        {"seq": 2, "text": json.dumps({**progress, "files": "12", "extra": "<b>x</b>"})},
    ]
    run_logs_append(node_id=run.node_id, run_id=run.pk, lines=lines)
    run.refresh_from_db()
    assert run.staging == {k: v for k, v in progress.items() if k != "files"}
    run_logs_append(
        node_id=run.node_id, run_id=run.pk, lines=[{"seq": 3, "text": json.dumps(progress)}]
    )
    client.force_login(researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "staging wiki-en: 3.2 of 12.0 GB, 1.1 GB reused" in page
    failed = {"event": "stage_failed", "dataset": "wiki-en", "message": "shard-00001.bin: sha256 …"}
    run_logs_append(
        node_id=run.node_id, run_id=run.pk, lines=[{"seq": 4, "text": json.dumps(failed)}]
    )
    assert (
        "staging wiki-en failed: shard-00001.bin" in client.get(f"/jobs/{job.pk}/").content.decode()
    )


def test_the_submit_form_reads_a_mixture():
    from apps.jobs.forms import _data_source

    assert _data_source("wiki-en=0.7, books=0.3") == {
        "data": {
            "mixture": [{"dataset": "wiki-en", "weight": 0.7}, {"dataset": "books", "weight": 0.3}]
        }
    }
    assert _data_source("/shared/tokens.bin") == {"dataset": "/shared/tokens.bin"}
