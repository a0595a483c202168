"""Hugging Face Llama weights in and out, checked against transformers' own LlamaForCausalLM.

A small random Llama (2 layers, width 64, 4 heads sharing 2 KV heads, vocabulary
256, rope_theta and rms_norm_eps away from the trainer's defaults, so a field
dropped on the way shows) is saved by transformers, imported into the trainer and
compared logit by logit; then trained from under torchrun (gloo) in several layouts,
each of whose first loss must be the Hugging Face model's loss on that batch; then
checkpointed under FSDP, exported and loaded back by transformers.

Tolerances: fp32 logits within 1e-5 (the same function, sums in another order);
bf16 logits within what bf16 itself moves them (each model's bf16 logits are compared
with the fp32 ones, and the trainer's error may be at most twice Hugging Face's, plus
a little); losses within 1e-4.
"""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

from workers.trainer import hf  # noqa: E402
from workers.trainer.config import ConfigError  # noqa: E402
from workers.trainer.data import Batches  # noqa: E402
from workers.trainer.model import Transformer  # noqa: E402
from workers.trainer.shards import open_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SEQ_LEN = 32
GLOBAL_BATCH = 4
SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "rope_theta": 5000.0,
    "rms_norm_eps": 1e-6,
}


def llama(directory: Path, *, seed: int = 0, max_shard_size=None, **changes) -> Path:
    """A random LlamaForCausalLM saved by transformers (safetensors) into `directory`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SIZES, **changes})
    model = transformers.LlamaForCausalLM(config)
    # Random norms, so a norm weight copied to the wrong place shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    learn(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def learn(model, steps: int = 60) -> None:
    """A few steps of Adam on synthetic windows the trainer's runs do not read first, so the
    model's loss is its own, far from a random model's ln(256)."""
    source = open_source("synthetic", seq_len=SEQ_LEN, vocab_size=SIZES["vocab_size"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        rows = torch.stack([source.window(1000 + 8 * step + j) for j in range(8)])
        logits = model(rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def reference(directory: Path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def imported(directory: Path) -> Transformer:
    shape = hf.HFCheckpoint(directory).shape
    model = Transformer(shape)
    model.init_weights(seed=1, device=torch.device("cpu"))
    hf.load_into([model], str(directory), shape)
    return model.eval()


def tokens(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(
        0, SIZES["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(3)
    )


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def single(scratch) -> Path:
    return llama(scratch / "single")


@pytest.fixture(scope="module")
def sharded(scratch) -> Path:
    directory = llama(scratch / "sharded", max_shard_size="40KB")
    assert (directory / hf.INDEX).is_file()
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 2
    return directory


# --- import, in one process ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_imported_logits_match_the_hugging_face_model(layout, request):
    directory = request.getfixturevalue(layout)
    x = tokens()
    with torch.no_grad():
        ours, theirs = imported(directory)(x), reference(directory)(x).logits
    assert theirs.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def _upload(client, bucket: str, prefix: str, directory: Path) -> None:
    for path in directory.iterdir():
        client.put_object(Bucket=bucket, Key=prefix + path.name, Body=path.read_bytes())


def test_an_s3_checkpoint_is_staged_onto_the_node_and_kept_in_step_with_s3(
    aws_endpoint, monkeypatch, tmp_path, sharded, single, capsys
):
    """init.hf on S3 (a moto server): the stage copies the directory into the node's cache,
    whose copy imports to the Hugging Face model's logits; a second stage fetches nothing;
    a changed object is fetched again, and what S3 no longer has is removed."""
    import boto3

    from workers.trainer import stage

    monkeypatch.setenv("AWS_ENDPOINT_URL", aws_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="models")
    _upload(client, "models", "llama/", sharded)
    client.put_object(Bucket="models", Key="llama/training_args.bin", Body=b"not weights")
    gets = []
    real = stage.s3_client

    def counting_client():
        made = real()
        original = made.get_object
        made.get_object = lambda **kw: gets.append(kw["Key"]) or original(**kw)
        return made

    dest = tmp_path / "cache" / "team" / "hf-0123"
    plan = {"hf": [{"name": "init.hf", "uri": "s3://models/llama/", "dest": str(dest)}]}
    total = sum(p.stat().st_size for p in sharded.iterdir())

    assert stage.stage_all(plan, counting_client) == 0
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in sharded.iterdir()
    )  # config, index, shards; not the .bin beside them
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            imported(dest)(x), reference(sharded)(x).logits, atol=1e-5, rtol=1e-5
        )

    gets.clear()
    assert stage.stage_all(plan, counting_client) == 0
    assert gets == []  # reused by ETag and size, nothing read from S3 or hashed
    end = [json.loads(x) for x in capsys.readouterr().out.splitlines()][-1]
    assert end["event"] == "stage_end" and end["reused_bytes"] == end["bytes"] == total

    # The prefix re-uploaded as one file: that file fetched (config.json is the same, so its
    # ETag too: kept), the shards and their index (which would still point at them) removed.
    for path in sharded.iterdir():
        client.delete_object(Bucket="models", Key=f"llama/{path.name}")
    _upload(client, "models", "llama/", single)
    gets.clear()
    assert stage.stage_all(plan, counting_client) == 0
    assert gets == ["llama/model.safetensors"]
    assert not (dest / hf.INDEX).exists() and not list(dest.glob("model-*-of-*"))
    with torch.no_grad():
        torch.testing.assert_close(
            imported(dest)(x), reference(single)(x).logits, atol=1e-5, rtol=1e-5
        )


def test_imported_bf16_logits_are_within_what_bf16_moves_them(single):
    x = tokens()
    with torch.no_grad():
        exact = reference(single)(x).logits
        theirs = reference(single, torch.bfloat16)(x).logits.float()
        ours = imported(single).to(torch.bfloat16)(x).float()
    their_error = (theirs - exact).abs().max().item()
    our_error = (ours - exact).abs().max().item()
    # bf16 moves them a little, never not at all (0.052 under transformers 5.25, against
    # ours 0.050; under 0.05 with the 5.x releases before it).
    assert 0 < their_error < 0.1
    assert our_error <= 2 * their_error + 1e-3


def test_the_shape_and_tied_embeddings_come_from_config_json(scratch):
    directory = llama(scratch / "tied", tie_word_embeddings=True)
    checkpoint = hf.HFCheckpoint(directory)
    assert checkpoint.shape.rope_theta == 5000.0 and checkpoint.shape.norm_eps == 1e-6
    assert (checkpoint.shape.dim, checkpoint.shape.kv_heads, checkpoint.shape.max_seq_len) == (
        64,
        2,
        64,
    )
    model = imported(directory)
    # The output head starts as the embedding and trains apart from it.
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(directory)(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"head_dim": 32}, "head_dim 32"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
    ],
)
def test_what_the_trainer_cannot_compute_is_refused_by_name(change, words):
    config = {"model_type": "llama", **SIZES, **change}
    with pytest.raises(hf.UnsupportedCheckpoint, match=words):
        hf.shape_from_config(config)


def test_a_checkpoint_that_does_not_fit_the_runs_model_is_refused_with_the_sizes_to_give(single):
    shape = hf.HFCheckpoint(single).shape
    other = Transformer(dataclasses.replace(shape, ffn_dim=192))
    with pytest.raises(ConfigError, match=r"ffn_dim 192 ≠ 128.*model\.sizes.*\"ffn_dim\": 128"):
        hf.load_into([other], str(single), other.shape)


def test_the_shape_command_prints_the_sizes_for_run_json(single):
    printed = subprocess.run(
        [sys.executable, "-m", "workers.trainer.hf", "shape", str(single)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    sizes = json.loads(printed)["sizes"]
    assert sizes["ffn_dim"] == 128 and sizes["rope_theta"] == 5000.0


# --- import under torchrun, training, export --------------------------------------------------


def run_config(directory: Path, *, layout=None, steps=1, checkpoint=None) -> dict:
    shape = hf.HFCheckpoint(directory).shape
    return {
        "model": {"sizes": hf.sizes_of(shape)},
        "init": {"hf": str(directory)},
        "data": {"dataset": "synthetic", "seq_len": SEQ_LEN},
        "schedule": {"steps": steps, "global_batch": GLOBAL_BATCH, "lr": 1e-3},
        "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **(layout or {})},
        "checkpoint": checkpoint or {},
        "precision": "fp32",
    }


def train(config: dict, workdir: Path) -> dict[int, float]:
    """Run the trainer (torchrun when the layout has several ranks); its losses by step."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.json").write_text(json.dumps(config))
    nproc = 1
    for size in config["layout"].values():
        nproc *= size
    trainer = ["-m", "workers.trainer", "--config", "run.json"]
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        trainer = [*launcher, *trainer]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, *trainer],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    events = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"event"')]
    assert any(e["event"] == "init" and e["path"] == str(config["init"]["hf"]) for e in events)
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def hugging_face_loss(directory: Path) -> float:
    """The Hugging Face model's mean next-token loss on the trainer's first batch."""
    source = open_source("synthetic", seq_len=SEQ_LEN, vocab_size=SIZES["vocab_size"])
    batches = Batches(source, seed=0, global_batch=GLOBAL_BATCH, dp_rank=0, dp_size=1)
    inputs, targets = batches.at(1)
    with torch.no_grad():
        logits = reference(directory)(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@pytest.fixture(scope="module")
def first_loss(sharded) -> float:
    loss = hugging_face_loss(sharded)
    # A random model's loss is about ln(256) = 5.55; the imported one's is its own.
    assert loss < math.log(SIZES["vocab_size"]) - 1
    return loss


@pytest.fixture(scope="module")
def fsdp_run(scratch, sharded) -> tuple[dict[int, float], Path]:
    """Two steps from the imported weights under FSDP on 2 ranks, checkpointed after the second."""
    checkpoints = scratch / "fsdp-checkpoints"
    config = run_config(
        sharded,
        layout={"dp_shard": 2},
        steps=2,
        checkpoint={"dir": str(checkpoints), "every_steps": 2},
    )
    return train(config, scratch / "fsdp"), checkpoints / "step-00000002"


@pytest.mark.slow
def test_fine_tuning_starts_at_the_imported_models_loss(scratch, sharded, first_loss, fsdp_run):
    alone = train(run_config(sharded, steps=2), scratch / "alone")
    assert alone[1] == pytest.approx(first_loss, abs=1e-4)
    # The same weights under FSDP: the same first loss, and the same step after it.
    losses, _ = fsdp_run
    assert losses[1] == pytest.approx(first_loss, abs=1e-4)
    assert losses[2] == pytest.approx(alone[2], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp", "pp"])
def test_every_layout_loads_the_same_model(layout, scratch, sharded, first_loss):
    losses = train(run_config(sharded, layout=layout), scratch / "-".join(layout))
    assert losses[1] == pytest.approx(first_loss, abs=1e-4)


@pytest.mark.slow
def test_an_fsdp_checkpoint_exports_to_a_model_transformers_loads(scratch, sharded, fsdp_run):
    _, checkpoint = fsdp_run
    out = scratch / "exported"
    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.trainer.hf",
            "export",
            "--checkpoint",
            str(checkpoint),
            "--out",
            str(out),
            "--dtype",
            "float32",
            "--max-shard-size",
            "50KB",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    record = json.loads(printed)
    assert record["step"] == 2 and hf.INDEX in record["files"]
    config = json.loads((out / hf.CONFIG).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"

    trained = Transformer(hf.HFCheckpoint(sharded).shape)
    trained.init_weights(seed=0, device=torch.device("cpu"))
    trained.load_state_dict(hf.read_model_state(checkpoint), strict=True)
    x = tokens()
    with torch.no_grad():
        ours = trained.eval()(x)
        theirs = reference(out)(x).logits
        before = reference(sharded)(x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (theirs - before).abs().max() > 1e-3  # two steps of training moved it

    # The default: bf16, one file, with the tokenizer named beside it.
    (scratch / "tok").mkdir()
    (scratch / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    record = hf.export(checkpoint, scratch / "bf16", tokenizer=scratch / "tok" / "tokenizer.json")
    assert record["files"] == [hf.SINGLE_FILE, hf.CONFIG, "tokenizer.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(scratch / "bf16")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        low = model(x).logits.float()
    # Weights rounded to bf16 (8 bits of mantissa) move logits by under 2% of their range.
    assert (low - ours).abs().max() < 0.02 * ours.abs().max()


@pytest.mark.slow
def test_a_corrupted_checkpoint_is_not_exported(scratch, fsdp_run):
    _, checkpoint = fsdp_run
    broken = scratch / "broken"
    shutil.copytree(checkpoint, broken)
    shard = next(p for p in broken.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its SHA-256"):
        hf.export(broken, scratch / "not-exported")
    assert not (scratch / "not-exported").exists()
