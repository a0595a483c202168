"""Each checkpoint keeps the trainer's latest evaluation ("eval" in its line), read
defensively (a bad one is dropped, never the line); the job's best checkpoint, the lowest
held-out loss of its committed or verified ones, is marked on the pages and in the API."""

import csv
import io
import math
from pathlib import Path

import pytest

from apps.checkpoints.api.reports import checkpoint_report_parse
from apps.checkpoints.models import Checkpoint
from apps.checkpoints.services import checkpoint_verify_request
from apps.jobs.models import Run
from apps.jobs.runconfig import checkpoint_dir
from tests.apps.checkpoints.conftest import agent_of, commit_event, report, write_checkpoint

pytestmark = pytest.mark.django_db

DIGEST = "a" * 64


def evaluation(step: int, loss, **extra) -> dict:
    """The trainer's "eval" of a checkpoint line (workers/trainer/train.py)."""
    return {
        "step": step,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700)) if isinstance(loss, float) else 1.0,
        "tokens": 4096,
        "datasets": {"web-en": {"loss": loss, "perplexity": 1.0, "tokens": 4096}},
        **extra,
    }


def parsed_eval(value):
    line = {"event": "checkpoint", "step": 20, "manifest_sha256": DIGEST, "path": "/c/20"}
    return checkpoint_report_parse({**line, "eval": value})["eval"]


def test_a_sound_eval_is_kept_as_step_loss_and_perplexity():
    assert parsed_eval(evaluation(20, 2.0)) == {
        "step": 20,
        "loss": 2.0,
        "perplexity": pytest.approx(math.exp(2.0)),
    }
    # An evaluation before the step saved (the latest one, every N steps) is its too.
    assert parsed_eval(evaluation(10, 2.5))["step"] == 10
    # A loss too large for its perplexity: the trainer prints Infinity; the loss is kept.
    assert parsed_eval(evaluation(20, 800.0, perplexity=math.inf)) == {
        "step": 20,
        "loss": 800.0,
        "perplexity": None,
    }


@pytest.mark.parametrize(
    "value",
    [
        None,
        "2.0",
        ["step", 20],
        evaluation(21, 2.0),  # after the checkpoint's step: not its evaluation
        evaluation(-1, 2.0),
        evaluation("20", 2.0),
        evaluation(True, 2.0),
        evaluation(20, math.nan),
        evaluation(20, math.inf),
        evaluation(20, -0.1),
        evaluation(20, "2.0"),
        evaluation(20, True),
        {"loss": 2.0},
    ],
)
def test_a_bad_eval_is_dropped_and_the_line_kept(value):
    assert parsed_eval(value) is None


@pytest.fixture
def evaluated(running_job):
    """Steps 10 to 50 committed, each with an evaluation: step 30 has the lowest loss but is
    corrupt, step 40's eval is garbage and step 50's is of a later step; step 20 is best."""
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    evals = {
        10: evaluation(10, 3.0),
        20: evaluation(20, 2.0),
        30: evaluation(30, 1.5),
        40: {"step": 40, "loss": "low"},
        50: evaluation(60, 1.0),
    }
    paths = {}
    for step, value in evals.items():
        path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), step, job=running_job)
        report(keeper, run, commit_event(path, digest, step, eval=value))
        paths[step] = path
    assert keeper.outbox.refused == []  # no line was refused for its eval
    keeper.poll_once()
    (paths[30] / "__1_0.distcp").write_bytes(b"rot")
    checkpoint_verify_request(checkpoint=Checkpoint.objects.get(step=30), by=None)
    keeper.poll_once()
    return running_job


def test_each_checkpoint_keeps_its_eval(evaluated):
    stored = {
        c.step: (c.state, c.eval_step, c.eval_loss)
        for c in Checkpoint.objects.filter(job=evaluated)
    }
    assert stored == {
        10: ("verified", 10, 3.0),
        20: ("verified", 20, 2.0),
        30: ("corrupt", 30, 1.5),
        40: ("verified", None, None),
        50: ("verified", None, None),
    }
    twenty = Checkpoint.objects.get(job=evaluated, step=20)
    assert twenty.eval_perplexity == pytest.approx(math.exp(2.0))


def test_the_best_checkpoint_is_marked_on_the_pages(client, evaluated, researcher):
    client.force_login(researcher)
    panel = client.get(f"/checkpoints/jobs/{evaluated.pk}/").content.decode()
    rows = {
        step: panel[panel.index(f'data-step="{step}"') :].split("</tr>")[0]
        for step in (10, 20, 30, 40, 50)
    }
    assert [step for step, row in rows.items() if 'class="badge best"' in row] == [20]
    assert "2.0000" in rows[20] and f"perplexity {math.exp(2.0):.2f}" in rows[20]
    assert "1.5000" in rows[30]  # the corrupt one's figures stay shown, unmarked
    assert "Best</dt><dd>step 20" in panel
    overview = client.get("/checkpoints/").content.decode()
    row = overview[overview.index(f'data-job="{evaluated.pk}"') :].split("</tr>")[0]
    assert "step 20" in row and "2.0000" in row
    # Its export button is the best one's, not the newest's (step 50).
    best = Checkpoint.objects.get(job=evaluated, step=20)
    assert f'action="/checkpoints/{best.pk}/export/"' in row and "Step 20 to HF" in row
    table = client.get("/checkpoints/checkpoints.csv").content.decode()
    (line,) = csv.DictReader(io.StringIO(table))
    assert (line["best_step"], line["best_eval_loss"]) == ("20", "2.0")


def test_the_api_gives_the_eval_fields_and_the_best_flag(api_for, evaluated, researcher):
    client = api_for(researcher)
    listed = client.get(f"/api/v1/checkpoints/?job_id={evaluated.pk}").json()["results"]
    fields = {c["step"]: (c["eval_loss"], c["eval_step"], c["best"]) for c in listed}
    assert fields == {
        10: (3.0, 10, False),
        20: (2.0, 20, True),
        30: (1.5, 30, False),
        40: (None, None, False),
        50: (None, None, False),
    }
    twenty = next(c for c in listed if c["step"] == 20)
    assert twenty["eval_perplexity"] == pytest.approx(math.exp(2.0))
    one = client.get(f"/api/v1/checkpoints/{twenty['id']}/").json()
    assert one["best"] is True
    summary = client.get(f"/api/v1/checkpoint-jobs/{evaluated.pk}/").json()
    assert (summary["best"]["step"], summary["best"]["eval_loss"]) == (20, 2.0)
    detail = client.get(f"/api/v1/jobs/{evaluated.pk}/").json()
    assert detail["checkpoints"]["best"]["id"] == twenty["id"]


def test_without_evaluations_there_is_no_best(api_for, client, running_job, researcher):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    (listed,) = api_for(researcher).get("/api/v1/checkpoints/").json()["results"]
    assert (listed["eval_loss"], listed["best"]) == (None, False)
    summary = api_for(researcher).get(f"/api/v1/checkpoint-jobs/{running_job.pk}/").json()
    assert summary["best"] is None
    client.force_login(researcher)
    panel = client.get(f"/checkpoints/jobs/{running_job.pk}/").content.decode()
    assert 'class="badge best"' not in panel and "no evaluation (trainer.eval)" in panel
