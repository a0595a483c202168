"""The trainer under torchrun on the CPU on a mixture of two prepared datasets: evaluation, resume.

Two datasets are prepared with a real `tokenizers` tokenizer (trained here, saved as
tokenizer.json), each with a held-out validation split. FSDP over two ranks trains
the `tiny` preset on the 3:1 mixture, evaluating every two steps and checkpointing
every three; one process then resumes from step 3 and must reproduce the rest of
the run, evaluations included (within test_training.py's loss tolerance: FSDP over
two ranks and one process add in different orders).
"""

import json
import math
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from tests.workers.trainer.test_datasets import make_tokenizer, texts, write_jsonl  # noqa: E402
from tests.workers.trainer.test_training import (  # noqa: E402
    LOSS_TOLERANCE,
    assert_same_losses,
    run_config,
    train,
)

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> list[dict]:
    from workers.trainer.prepare import prepare_sharded

    scratch = tmp_path_factory.mktemp("mixture")
    prose, counting = (
        texts(300),
        [" ".join(str(n % 40) for n in range(i, i + 30)) for i in range(200)],
    )
    tokenizer_file = make_tokenizer(scratch / "tokenizer", prose + counting)
    parts = []
    for name, documents, weight in (("prose", prose, 3), ("counting", counting, 1)):
        prepare_sharded(
            [write_jsonl(scratch / "in" / f"{name}.jsonl", documents)],
            scratch / name,
            tokenizer_file=tokenizer_file,
            validation=0.1,
            shard_tokens=2000,
        )
        parts.append({"path": str(scratch / name), "weight": weight})
    return parts


def mixture_config(parts, **extra) -> dict:
    config = run_config(Path("unused"), eval={"every": 2, "batches": 2}, **extra)
    config["data"] = {"mixture": parts, "seq_len": 32}
    return config


def test_a_mixture_trains_evaluates_and_resumes_on_fewer_ranks(mixture, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    config = mixture_config(
        mixture,
        layout={"dp_shard": 2},
        checkpoint={"dir": str(checkpoints), "every_steps": 3},
        steps=STEPS,
    )
    run = train(config, tmp_path / "fsdp", nproc=2)

    evals = {e["step"]: e for e in run.of("eval")}
    assert sorted(evals) == [2, 4, 6]  # every two steps; the last step is one of them
    for event in evals.values():
        assert math.isfinite(event["loss"]) and 0 < event["loss"] < 10
        assert event["perplexity"] == pytest.approx(math.exp(event["loss"]), rel=1e-9)
        assert set(event["datasets"]) == {"prose", "counting"}
        # Two global batches of 8 sequences of 32 predicted tokens, per dataset.
        assert event["tokens"] == 2 * (2 * 8 * 32)
        weighted = (
            3 * event["datasets"]["prose"]["loss"] + event["datasets"]["counting"]["loss"]
        ) / 4
        assert event["loss"] == pytest.approx(weighted, abs=1e-5)
    assert evals[6]["loss"] < evals[2]["loss"]  # it learns, on sequences it never trained on

    # A checkpoint keeps the latest evaluation and where it was in each dataset.
    manifest = json.loads((checkpoints / "step-00000003" / "manifest.json").read_text())
    assert manifest["eval"]["step"] == 2 and manifest["eval"]["loss"] == evals[2]["loss"]
    datasets = manifest["data"]["datasets"]
    assert [(d["name"], d["weight"]) for d in datasets] == [("prose", 3), ("counting", 1)]
    assert sum(d["samples"] for d in datasets) == manifest["data"]["samples_seen"] == 3 * 8
    assert run.of("checkpoint")[-1]["eval"]["step"] == 6

    # One process takes up step 3's checkpoint (same global batch) and continues alike.
    resumed = train(
        mixture_config(
            mixture,
            checkpoint={"resume_from": str(checkpoints / "step-00000003")},
            steps=STEPS,
        ),
        tmp_path / "resumed",
    )
    assert resumed.of("resume")[0]["step"] == 3
    assert_same_losses(resumed, run, range(4, STEPS + 1))
    again = {e["step"]: e for e in resumed.of("eval")}
    assert sorted(again) == [4, 6]
    for step in (4, 6):
        assert abs(again[step]["loss"] - evals[step]["loss"]) <= LOSS_TOLERANCE

    # Exported, it carries the tokenizer its datasets were prepared with, which transformers
    # loads beside the model.
    from workers.trainer import hf

    exported = hf.export(checkpoints / "step-00000003", tmp_path / "exported")
    assert "tokenizer.json" in exported["files"]
    prepared = Path(mixture[0]["path"]) / "tokenizer.json"
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == prepared.read_bytes()
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    text = "pack my box with five dozen liquor jugs"
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert loaded(text)["input_ids"] == Tokenizer.from_file(str(prepared)).encode(text).ids

    # A tokenizer.json changed since its dataset was prepared speaks for nothing.
    manifest = json.loads((checkpoints / "step-00000003" / "manifest.json").read_text())
    for dataset in manifest["data"]["datasets"]:
        copy = tmp_path / "copies" / dataset["name"]
        shutil.copytree(dataset["path"], copy)
        dataset["path"] = str(copy)
    for name, expected in (("counting", "prose"), ("prose", None)):  # counting is read first
        changed = tmp_path / "copies" / name / "tokenizer.json"
        changed.write_text(changed.read_text().replace("quartz", "granite"))
        found = hf.trained_tokenizer(manifest)
        assert found == (expected and tmp_path / "copies" / expected / "tokenizer.json")


@pytest.fixture(scope="module")
def one_process(mixture, tmp_path_factory):
    return train(mixture_config(mixture, steps=3), tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 2}], ids=["pp", "tp"])
def test_evaluation_under_pipeline_and_tensor_parallelism(mixture, one_process, layout, tmp_path):
    """Pipeline stages evaluate through the forward-only schedule, between training steps;
    tensor-parallel ranks count the loss once."""
    run = train(mixture_config(mixture, layout=layout, steps=3), tmp_path, nproc=2)
    # Training carries on alike after an evaluation (step 3 follows step 2's).
    assert_same_losses(run, one_process, [1, 2, 3])
    assert [e["step"] for e in run.of("eval")] == [2, 3]
    for event, expected in zip(run.of("eval"), one_process.of("eval"), strict=True):
        assert abs(event["loss"] - expected["loss"]) <= LOSS_TOLERANCE
