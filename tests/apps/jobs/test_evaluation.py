"""Held-out evaluation (trainer.eval): checked at submission, passed to run.json, its `eval`
lines kept as EvalMetric rows (hostile values dropped), drawn on the Job page beside the
training loss and served by the API, as JSON and CSV."""

import csv
import io
import json
import math

import pytest

from apps.jobs import datasets
from apps.jobs.dispatch import job_dispatch, run_logs_append
from apps.jobs.models import EvalMetric, Job, Run
from apps.jobs.runconfig import trainer_run_config
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import trainer_spec
from tests.apps.jobs.test_datasets import SHA, mixture_spec

pytestmark = pytest.mark.django_db


def prepared_index(*, validation_tokens: int | None) -> dict:
    """An index as workers/trainer/prepare.py writes it (splits), with or without held-out
    documents."""
    shard = {"file": "train-00000.bin", "tokens": 4000, "documents": 40, "sha256": SHA}
    splits = {"train": {"tokens": 4000, "documents": 40, "shards": [shard]}}
    if validation_tokens is not None:
        held = {**shard, "file": "validation-00000.bin", "tokens": validation_tokens}
        splits["validation"] = {"tokens": validation_tokens, "documents": 2, "shards": [held]}
    return {
        "format": "controlplane-dataset",
        "version": 1,
        "tokenizer": {"name": "bpe", "sha256": SHA, "vocab_size": 256},
        "splits": splits,
    }


def register(team, name="web-en", validation_tokens: int | None = 600):
    return datasets.dataset_register(
        team=team,
        name=name,
        uri=f"/shared/data/{name}",
        index=prepared_index(validation_tokens=validation_tokens),
        by=None,
    )


def with_eval(spec: dict, **evaluation) -> dict:
    spec["trainer"]["eval"] = evaluation
    return spec


def submit(api_for, user, spec):
    return api_for(user, scopes=("submit",)).post("/api/v1/jobs/", spec, format="json")


# --- job specs and run.json -----------------------------------------------------------------


def test_eval_reaches_run_json_and_defaults_to_off(fleet_pool, quota, team, researcher, api_for):
    register(team)
    spec = with_eval(mixture_spec(team, [{"dataset": "web-en", "weight": 1}]), every=2, batches=3)
    answer = submit(api_for, researcher, spec)
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    config = json.loads(trainer_run_config(job, attempt=1))
    assert config["eval"] == {"every": 2, "batches": 3}
    assert config["data"]["mixture"] == [
        {"path": "/shared/data/web-en", "weight": 1.0, "name": "web-en"}
    ]
    plain = submit(api_for, researcher, trainer_spec(team))
    job = Job.objects.get(pk=plain.json()["id"])
    assert json.loads(trainer_run_config(job, attempt=1))["eval"] == {"every": 0, "batches": 1}
    # batches defaults to one global batch; every 0 on synthetic data is evaluation off.
    one = submit(api_for, researcher, with_eval(trainer_spec(team), every=0))
    assert one.status_code == 201, one.content
    assert Job.objects.get(pk=one.json()["id"]).spec["trainer"]["eval"] == {
        "every": 0,
        "batches": 1,
    }


@pytest.mark.parametrize(
    ("evaluation", "field"),
    [
        ({"every": -1}, "trainer.eval.every"),
        ({"every": 1.5}, "trainer.eval.every"),
        ({"batches": 2}, "trainer.eval.every"),
        ({"every": 10, "batches": 0}, "trainer.eval.batches"),
        ({"every": 10, "data": "/x"}, "trainer.eval.data"),
    ],
)
def test_a_bad_eval_section_is_a_400_naming_the_field(
    evaluation, field, fleet_pool, quota, team, researcher, api_for
):
    register(team)
    spec = mixture_spec(team, [{"dataset": "web-en", "weight": 1}])
    answer = submit(api_for, researcher, with_eval(spec, **evaluation))
    assert answer.status_code == 400
    assert named(answer.json()["error"]["details"], field), answer.json()
    assert not Job.objects.exists()


def named(details: dict, path: str):
    """The errors at `path` (trainer.eval.every) of a 400's details: the submit serializer
    nests them by field, the spec rules name the path flat."""
    if path in details:
        return details[path]
    for key in path.split("."):
        details = details.get(key) if isinstance(details, dict) else None
    return details


def test_synthetic_data_has_nothing_to_evaluate_on(fleet_pool, quota, team, researcher, api_for):
    answer = submit(api_for, researcher, with_eval(trainer_spec(team), every=100))
    assert answer.status_code == 400
    (reason,) = answer.json()["error"]["details"]["trainer.eval.every"]
    assert "Synthetic tokens have no held-out split" in reason


def test_a_mixture_needs_a_validation_split_of_a_sequence(
    fleet_pool, quota, team, researcher, api_for
):
    register(team, name="none-held", validation_tokens=None)
    register(team, name="too-short", validation_tokens=256)  # seq_len 256: a window is 257
    mixture = [{"dataset": "none-held", "weight": 1}, {"dataset": "too-short", "weight": 1}]
    answer = submit(api_for, researcher, with_eval(mixture_spec(team, mixture), every=5))
    assert answer.status_code == 400
    (reason,) = answer.json()["error"]["details"]["trainer.eval.every"]
    assert "No dataset of the mixture has a validation split" in reason
    # One dataset of the mixture with held-out sequences is enough: the trainer evaluates it.
    register(team, name="held", validation_tokens=257)
    mixture.append({"dataset": "held", "weight": 1})
    answer = submit(api_for, researcher, with_eval(mixture_spec(team, mixture), every=5))
    assert answer.status_code == 201, answer.content


# --- eval lines → EvalMetric ----------------------------------------------------------------


@pytest.fixture
def run(fleet_pool, quota, team, researcher, api_for) -> Run:
    register(team)
    spec = with_eval(mixture_spec(team, [{"dataset": "web-en", "weight": 1}]), every=10)
    job = Job.objects.get(pk=submit(api_for, researcher, spec).json()["id"])
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    return Run.objects.get(job=job)


def eval_line(step, loss, **extra) -> dict:
    return {
        "event": "eval",
        "step": step,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700)) if isinstance(loss, float) else 1.0,
        "tokens": 65536,
        "time": 1.8e9,
        "datasets": {"web-en": {"loss": loss, "perplexity": 1.0, "tokens": 65536}},
        **extra,
    }


def append(run: Run, *events, stream="stdout", first_seq=1) -> None:
    lines = [
        {"seq": first_seq + n, "text": e if isinstance(e, str) else json.dumps(e), "at": 1.8e9}
        for n, e in enumerate(events)
    ]
    for line in lines:
        line["stream"] = stream
    run_logs_append(node_id=run.node_id, run_id=run.pk, lines=lines)


def test_eval_lines_are_kept_once_per_attempt_and_step(run):
    append(run, eval_line(10, 3.25), eval_line(20, 2.5), {"event": "step", "step": 20, "loss": 3.0})
    append(run, eval_line(20, 2.5), first_seq=50)  # the agent's retry, or a printed repeat
    rows = list(EvalMetric.objects.filter(job=run.job).values_list("step", "loss", "tokens"))
    assert rows == [(10, 3.25, 65536), (20, 2.5, 65536)]
    ten = EvalMetric.objects.get(job=run.job, step=10)
    assert ten.attempt == 1 and ten.perplexity == pytest.approx(math.exp(3.25))


def test_hostile_eval_lines_are_dropped_or_trimmed(run):
    append(
        run,
        '{"event": "eval", "step": 1, "loss": NaN, "perplexity": NaN}',
        '{"event": "eval", "step": 2, "loss": Infinity}',
        eval_line(3, -0.5),
        eval_line(4, 1e6),
        eval_line("5", 2.0),
        eval_line(True, 2.0),
        eval_line(-6, 2.0),
        eval_line(2**31, 2.0),
        eval_line(8, True),
        eval_line(9, "2.0"),
        '{"event": "eval", "step": 10, "loss": 2.0',  # cut short
        ["not", "an", "object"],
        eval_line(11, 2.0),
    )
    append(run, eval_line(12, 2.0), stream="stderr", first_seq=100)  # only stdout is the trainer's
    # Kept, without what does not hold: a perplexity that is not exp(loss), a token count
    # that is not a whole number.
    append(run, eval_line(13, 2.0, perplexity=1e300, tokens=1.5), first_seq=200)
    append(run, eval_line(14, 2.0, perplexity=-1, tokens=-3), first_seq=300)
    rows = {
        e.step: (e.loss, e.perplexity, e.tokens) for e in EvalMetric.objects.filter(job=run.job)
    }
    assert rows == {
        11: (2.0, pytest.approx(math.exp(2.0)), 65536),
        13: (2.0, None, None),
        14: (2.0, None, None),
    }


# --- the Job page and the API ---------------------------------------------------------------


def test_the_job_page_charts_eval_loss_beside_the_training_loss(run, client, researcher):
    append(
        run,
        *({"event": "step", "step": s, "loss": 5.0 - s / 10} for s in range(1, 21)),
        eval_line(10, 4.25),
        eval_line(20, 3.5),
    )
    client.force_login(researcher)
    panel = client.get(f"/jobs/{run.job_id}/training/").content.decode()
    assert "Loss (training, and held-out: eval)" in panel
    # The eval series: a line with a dot per evaluation, whose tooltip gives its perplexity.
    assert '<polyline class="series bold"' in panel and "<title>eval</title>" in panel
    assert panel.count('<circle class="point"') == 2
    assert f"eval at step 20 (attempt 1): loss 3.5000, perplexity {math.exp(3.5):.4g}" in panel
    # The table: newest first, with perplexity and tokens, and where the CSV is.
    table = panel[panel.index('id="evaluations-table"') :]
    assert table.index('data-step="20"') < table.index('data-step="10"')
    assert f"{math.exp(3.5):.2f}" in table and "65536" in table
    assert f"/api/v1/jobs/{run.job_id}/evaluations/?format=csv" in table
    # The newest evaluation in the summary.
    assert "Eval loss" in panel and "3.5000" in panel


def test_a_single_evaluation_still_shows(run, client, researcher):
    append(run, {"event": "step", "step": 1, "loss": 5.0}, eval_line(1, 4.5))
    client.force_login(researcher)
    panel = client.get(f"/jobs/{run.job_id}/training/").content.decode()
    assert panel.count('<circle class="point"') == 1


def test_the_api_serves_the_evaluations_as_json_and_csv(run, api_for, researcher, other_member):
    append(run, eval_line(10, 3.25), eval_line(20, 2.5))
    client = api_for(researcher)
    answer = client.get(f"/api/v1/jobs/{run.job_id}/evaluations/")
    assert answer.status_code == 200
    assert [(e["attempt"], e["step"], e["loss"], e["tokens"]) for e in answer.json()] == [
        (1, 10, 3.25, 65536),
        (1, 20, 2.5, 65536),
    ]
    assert answer.json()[1]["perplexity"] == pytest.approx(math.exp(2.5))
    table = client.get(f"/api/v1/jobs/{run.job_id}/evaluations/?format=csv")
    assert table["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(table.content.decode())))
    assert [(r["step"], r["loss"]) for r in rows] == [("10", "3.25"), ("20", "2.5")]
    assert list(rows[0]) == ["attempt", "step", "loss", "perplexity", "tokens", "at"]
    outsider = other_member
    assert api_for(outsider).get(f"/api/v1/jobs/{run.job_id}/evaluations/").status_code == 404
    missing = api_for(outsider).get(f"/api/v1/jobs/{run.job_id}/evaluations/?format=csv")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
