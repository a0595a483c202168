"""A trainer job end to end on `make run`'s configuration: submitted through the API, run by
local nodes' agents under torchrun (CPU, gloo), metrics and checkpoints reported back."""

import json

import pytest

from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, StepMetric
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
