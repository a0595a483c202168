"""A trainer job end to end on `make run`'s configuration: submitted through the API, run by
local nodes' agents under torchrun (CPU, gloo), metrics and checkpoints reported back."""

import json

import pytest

from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import EvalMetric, Job, StepMetric
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_a_tiny_trainer_job_trains_on_local_nodes_and_succeeds(
    local_nodes, e2e_team, api_for, settings, tmp_path
):
    pool = factories.make_owned_pool(slug="e2e-train")
    local_nodes(pool, count=1, gpus=2)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    spec = {
        "name": "tiny-pretrain",
        "team": e2e_team.pk,
        "time_limit_s": 900,
        "trainer": {
            "preset": "tiny",
            "dataset": "synthetic",
            "steps": 12,
            "global_batch": 4,
            "seq_len": 64,
            "precision": "fp32",
            "checkpoint_every_steps": 5,
        },
        "resources": {"gpu_type": "H100", "nodes": 1, "gpus_per_node": 2},
        "placement": {"where": "owned"},
    }
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    job = wait_for(
        "the training run to end",
        lambda: (j := Job.objects.get(pk=job.pk)).state in ("succeeded", "failed") and j,
        timeout_s=300,
        every_s=1.0,
    )
    texts = [line["text"] for line in api.get(f"/api/v1/jobs/{job.pk}/logs/").json()["lines"]]
    assert job.state == "succeeded", (job.state_reason, texts[-20:])
    steps = wait_for(
        "every step's metrics",
        lambda: (
            (n := list(StepMetric.objects.filter(job=job).order_by("step"))) and len(n) == 12 and n
        ),
    )
    assert [m.step for m in steps] == list(range(1, 13))
    assert all(m.loss is not None and m.tokens_per_s for m in steps)
    assert steps[-1].loss < steps[0].loss  # it learns something even in 12 steps
    events = [json.loads(t) for t in texts if t.startswith('{"event":')]
    checkpoints = [e for e in events if e["event"] == "checkpoint"]
    assert [c["step"] for c in checkpoints][:2] == [5, 10]
    assert all(len(c["manifest_sha256"]) == 64 for c in checkpoints)
    page = api.get(f"/api/v1/jobs/{job.pk}/").json()
    assert page["state"] == "succeeded"


def test_a_job_on_a_prepared_dataset_evaluates_and_its_checkpoints_keep_the_figures(
    local_nodes, e2e_team, api_for, tmp_path, open_dir
):
    """The tiny preset on a registered shared-path dataset with a validation split, evaluated
    every 2 steps: the eval lines become EvalMetric rows and each checkpoint keeps its eval."""
    from apps.checkpoints.models import Checkpoint
    from apps.jobs import datasets
    from tests.e2e.conftest import log_texts, trainer_job_run
    from tests.workers.trainer.test_datasets import make_tokenizer, texts, write_jsonl
    from workers.trainer.prepare import prepare_sharded

    corpus = texts(400)
    tokenizer_file = make_tokenizer(tmp_path / "tokenizer", corpus)
    inputs = write_jsonl(tmp_path / "in" / "part-0.jsonl", corpus)
    index = prepare_sharded(
        [inputs], open_dir / "web", tokenizer_file=tokenizer_file, validation=0.1, shard_tokens=900
    )  # where the run's own user reaches it
    datasets.dataset_register(
        team=e2e_team, name="web", uri=str(open_dir / "web"), index=index, by=None
    )
    pool = factories.make_owned_pool(slug="e2e-eval")
    local_nodes(pool, count=1, gpus=1)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    spec = {
        "name": "tiny-eval",
        "team": e2e_team.pk,
        "time_limit_s": 900,
        "trainer": {
            "preset": "tiny",
            "data": {"mixture": [{"dataset": "web", "weight": 1}]},
            "eval": {"every": 2, "batches": 1},
            "steps": 4,
            "global_batch": 2,
            "seq_len": 32,
            "precision": "fp32",
            "checkpoint_every_steps": 2,
        },
        "resources": {"gpu_type": "H100", "nodes": 1, "gpus_per_node": 1},
        "placement": {"where": "owned"},
    }
    finished = trainer_job_run(api, spec, timeout_s=120)
    job = finished.job
    assert job.state == "succeeded", (job.state_reason, log_texts(api, job)[-20:])
    evaluations = wait_for(
        "the eval lines",
        lambda: (
            (e := list(EvalMetric.objects.filter(job=job).order_by("step"))) and len(e) == 2 and e
        ),
    )
    assert [e.step for e in evaluations] == [2, 4]
    assert all(e.loss > 0 and e.perplexity and e.tokens for e in evaluations)
    checkpoints = wait_for(
        "the checkpoints",
        lambda: (
            (c := list(Checkpoint.objects.filter(job=job).order_by("step"))) and len(c) == 2 and c
        ),
    )
    assert [(c.step, c.eval_step) for c in checkpoints] == [(2, 2), (4, 4)]
    assert [c.eval_loss for c in checkpoints] == [e.loss for e in evaluations]
    answer = api.get(f"/api/v1/jobs/{job.pk}/evaluations/").json()
    assert [e["step"] for e in answer] == [2, 4]
