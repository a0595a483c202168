"""The trainer's small parts, in one process: run.json, data order, schedule, tokenizers, status."""

import dataclasses
import json
import math

import pytest

torch = pytest.importorskip("torch")

from workers.trainer import config as run_config  # noqa: E402
from workers.trainer.data import Batches, SyntheticSource, TokenFile, read_header  # noqa: E402
from workers.trainer.model import Transformer  # noqa: E402
from workers.trainer.optim import Optimizers, learning_rate  # noqa: E402
from workers.trainer.prepare import decode_file, prepare  # noqa: E402
from workers.trainer.presets import PRESETS, flops_per_token  # noqa: E402
from workers.trainer.stopping import STATUS_FILE_VARIABLE, write_status  # noqa: E402

TINY_SIZES = dataclasses.asdict(PRESETS["tiny"])

# --- run.json ------------------------------------------------------------------------------------


def test_a_short_run_json_gets_defaults():
    config = run_config.parse({"model": {"preset": "tiny"}, "data": {"seq_len": 64}})

    assert config.model == PRESETS["tiny"]
    assert config.layout.world_size == 1
    assert config.data.dataset == "synthetic"
    assert config.checkpoint.dir is None
    assert config.activation_checkpointing == "none"


def test_what_the_control_plane_writes_parses():
    written = {
        "job": {"id": 7, "uuid": "u", "attempt": 2, "name": "x"},
        "model": {"preset": None, "sizes": {"layers": 2, "dim": 32, "heads": 4, "kv_heads": 2,
                                            "ffn_dim": 64, "vocab_size": 300}},
        "data": {"dataset": "/data/tokens.bin", "seq_len": 128},
        "schedule": {"steps": 10, "global_batch": 8},
        "precision": "bf16",
        "activation_checkpointing": "selective",
        "compile": False,
        "layout": {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1},
        "checkpoint": {"dir": "/ckpt/t/job-7", "every_steps": 5, "every_minutes": None,
                       "resume_from": None, "keep": 2},
        "collective_timeout_s": 300,
        "seed": 3,
        "log_every": 1,
    }  # fmt: skip

    config = run_config.parse(written)

    assert config.model.vocab_size == 300
    assert config.layout.dp == 2
    assert config.local_batch == 4
    assert config.checkpoint.keep == 2
    assert config.collective_timeout_s == 300


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layout": {"tp": 3}}, "layout.tp"),
        ({"layout": {"pp": 3}}, "layers"),
        ({"schedule": {"global_batch": 3}, "layout": {"dp_shard": 2}}, "global_batch"),
        ({"precision": "fp16"}, "precision"),
        ({"precision": "fp8", "layout": {"tp": 2}}, "layout.tp"),
        ({"precision": "fp8", "kernels": {"float8_recipe": "blockwise"}}, "float8_recipe"),
        ({"precision": "fp8", "data": {"seq_len": 40}}, "data.seq_len 40"),
        (
            {"precision": "fp8", "model": {"sizes": {**TINY_SIZES, "dim": 72, "heads": 4}}},
            "dim 72, heads × head_dim 72",
        ),
        ({"activation_checkpointing": "some"}, "activation_checkpointing"),
        ({"schedule": {"stpes": 3}}, "stpes"),
        ({"colour": "blue"}, "colour"),
        ({"model": {"preset": "nope"}}, "preset"),
        ({"data": {"seq_len": 4096}}, "seq_len"),
        ({"kernels": {"compile_scope": "stage"}}, "compile_scope"),
        ({"kernels": {"compile_scope": "model"}, "layout": {"pp": 2}}, "compile_scope"),
    ],
)
def test_impossible_settings_are_refused_by_name(change, field):
    data = {"model": {"preset": "tiny"}, "data": {"seq_len": 64}, **change}

    with pytest.raises(run_config.ConfigError, match=field):
        run_config.parse(data)


# --- the schedule and the model's arithmetic ------------------------------------------------------


def test_warmup_then_cosine_to_the_floor():
    schedule = run_config.Schedule(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)

    assert learning_rate(schedule, 5) == pytest.approx(0.5)
    assert learning_rate(schedule, 10) == pytest.approx(1.0)
    assert learning_rate(schedule, 60) == pytest.approx(0.55)
    assert learning_rate(schedule, 110) == pytest.approx(0.1)
    rates = [learning_rate(schedule, s) for s in range(10, 111)]
    assert rates == sorted(rates, reverse=True)


@pytest.mark.parametrize("gradient_size", [0.01, 10.0])  # under the clip, and far over it
def test_clipping_inside_the_fused_step_matches_clipping_before_it(gradient_size):
    # A large eps makes Adam's step depend on the gradient's size (else its first step is
    # the same for g and 0.1·g), so a clip that was not applied would show.
    schedule = run_config.Schedule(grad_clip=1.0, eps=1.0)
    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    grads = [torch.randn_like(p) * gradient_size for p in models[0].parameters()]
    for model in models:
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad.clone()
    in_step = Optimizers([models[0]], schedule, fused=True)  # fused AdamW runs on CPUs too
    before = Optimizers([models[1]], schedule, fused=False)
    unclipped = Optimizers([models[2]], dataclasses.replace(schedule, grad_clip=0.0), fused=False)

    norms = []
    for optimizers in (in_step, before, unclipped):
        norms.append(float(optimizers.clip()))
        optimizers.step()

    assert in_step.clip_in_step and not before.clip_in_step
    assert norms[0] == pytest.approx(norms[1], rel=1e-6) == pytest.approx(norms[2], rel=1e-6)
    for fused, plain, free in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
        assert fused.grad is None  # zeroed for the next step
        if gradient_size > 1:  # clipped: the step differs from the unclipped one
            assert not torch.allclose(fused, free)
        else:
            torch.testing.assert_close(fused, free, rtol=1e-5, atol=1e-6)
    assert not hasattr(in_step.optimizers[0], "grad_scale")  # the scale lives for one step


def test_flops_per_token_is_six_n_plus_attention():
    shape = PRESETS["1b"]

    assert shape.parameters() == 1_100_048_384
    assert flops_per_token(shape, 2048) == 6 * 1_100_048_384 + 12 * 22 * 2048 * 2048


def test_the_model_has_the_parameters_its_preset_counts_and_initialises_by_name():
    shape = PRESETS["tiny"]
    first, second = Transformer(shape), Transformer(shape)
    first.init_weights(seed=1, device=torch.device("cpu"))
    second.init_weights(seed=1, device=torch.device("cpu"))

    assert sum(p.numel() for p in first.parameters()) == shape.parameters()
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True)
    )
    # A pipeline stage keeps only some blocks; those it keeps start the same.
    del second.layers["0"]
    second.init_weights(seed=1, device=torch.device("cpu"))
    assert torch.equal(
        first.layers["1"].attention.wq.weight, second.layers["1"].attention.wq.weight
    )
    logits = first(torch.randint(0, shape.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, shape.vocab_size)


# --- data ----------------------------------------------------------------------------------------


def test_data_parallel_ranks_split_the_global_batch_of_every_step():
    source = SyntheticSource(vocab_size=256, seq_len=16)
    whole = Batches(source, seed=0, global_batch=8, dp_rank=0, dp_size=1)
    halves = [Batches(source, seed=0, global_batch=8, dp_rank=r, dp_size=2) for r in range(2)]

    for step in (1, 2, 9):
        inputs, targets = whole.at(step)
        assert torch.equal(torch.cat([h.at(step)[0] for h in halves]), inputs)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_a_token_file_is_shuffled_per_epoch_and_resumes_in_order(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(16 * 10 + 1)))
    prepare([text], tmp_path / "tokens.bin")
    source = TokenFile(tmp_path / "tokens.bin", seq_len=16)
    assert source.windows == 10

    batches = Batches(source, seed=5, global_batch=4, dp_rank=0, dp_size=1)
    seen = [batches.at(step)[0] for step in range(1, 6)]  # 20 windows: two epochs
    first_epoch = torch.cat(seen)[:10]
    assert sorted(row[0].item() for row in first_epoch) == sorted(
        source.window(i)[0].item() for i in range(10)
    )

    # A run resumed after step 3 with another global batch carries on where the data was.
    resumed = Batches(source, seed=5, global_batch=2, dp_rank=0, dp_size=1)
    resumed.rebase(3, batches.position(3)["samples_seen"])
    assert torch.equal(torch.cat([resumed.at(4)[0], resumed.at(5)[0]]), seen[3])


# --- prepare -------------------------------------------------------------------------------------

TEXTS = {
    "a.txt": "Hello, world_1! Ünïcödé 東京 ²³ tabs\there\n\nand  double  spaces.\n",
    "b.txt": "the cat sat on the mat; " * 50,
    "c.txt": "",
}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_prepare_round_trips_text(tmp_path, tokenizer):
    folder = tmp_path / "texts"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / name).write_text(text, encoding="utf-8")

    header = prepare([folder], tmp_path / "tokens.bin", tokenizer=tokenizer, vocab_size=320)

    assert decode_file(tmp_path / "tokens.bin") == list(TEXTS.values())
    info = read_header(tmp_path / "tokens.bin")
    assert info.tokens == header["tokens"]
    if tokenizer == "bpe":
        assert 256 < info.vocab_size <= 320
        # Merges make the repetitive document shorter than its bytes.
        assert info.tokens < sum(len(t.encode()) for t in TEXTS.values())
    else:
        assert info.vocab_size == 256


# --- the exit status -----------------------------------------------------------------------------


def test_a_weightier_exit_reason_is_not_overwritten(tmp_path, monkeypatch):
    status = tmp_path / "status.json"
    monkeypatch.setenv(STATUS_FILE_VARIABLE, str(status))

    write_status("collective_timeout", step=4, message="peer gone", rank=1)
    write_status("code_error", step=4, message="ValueError: bad", rank=0)
    write_status("collective_timeout", step=4, message="peer gone", rank=2)
    write_status("finished", step=4, rank=3)
    write_status("storage", step=4, message="checkpoint: needs 1.0 GB", rank=4)

    recorded = json.loads(status.read_text())
    assert recorded["reason"] == "code_error"
    assert recorded["message"] == "ValueError: bad"


def test_errors_are_classified_as_the_job_s_or_the_infrastructure_s():
    from workers.trainer.__main__ import classify
    from workers.trainer.checkpoint import StorageError

    assert classify(ValueError("shapes do not match")) == "code_error"
    assert classify(RuntimeError("CUDA out of memory")) == "code_error"
    assert classify(RuntimeError("Timed out waiting 600000ms for recv")) == "collective_timeout"
    assert classify(torch.distributed.DistNetworkError("Connection reset")) == "collective_timeout"
    assert classify(StorageError("checkpoint: needs 13.2 GB at /c, 4.1 GB free")) == "storage"
    # Unwrapped, the same words are the job's own (the checkpointer wraps what it saw fail).
    assert classify(OSError(28, "No space left on device")) == "code_error"


def test_storage_failures_are_told_from_others_also_inside_dcp_s_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    from workers.trainer.checkpoint import is_storage_failure

    assert is_storage_failure(OSError(28, "No space left on device"))
    assert is_storage_failure(
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    )
    assert not is_storage_failure(RuntimeError("CUDA out of memory"))
    wrapped = CheckpointException("save failed", {1: (OSError(28, "No space left on device"), [])})
    assert is_storage_failure(wrapped)
    assert not is_storage_failure(CheckpointException("save failed", {0: (ValueError("bad"), [])}))


def test_the_env_event_names_the_rank_and_keeps_only_nccl_torch_nccl_and_efa_variables():
    from workers.trainer.metrics import environment_event

    started_with = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "2",
        "CONTROLPLANE_NODE_RANK": "0",  # the rendezvous's node rank wins over the plan's
        "WORLD_SIZE": "8",
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "FI_EFA_FORK_SAFE": "1",
        "OFI_NCCL_PROTOCOL": "RDMA",
        "RDMAV_FORK_SAFE": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "HOME": "/root",
        "MY_NCCL_DEBUG": "x",
    }
    event = environment_event(started_with)
    assert event == {
        "event": "env",
        "rank": 5,
        "local_rank": 1,
        "node_rank": 2,
        "world_size": 8,
        "env": {
            "FI_EFA_FORK_SAFE": "1",
            "NCCL_DEBUG": "WARN",
            "OFI_NCCL_PROTOCOL": "RDMA",
            "RDMAV_FORK_SAFE": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        },
    }
    # The control plane looks for the event key first on the line.
    assert json.dumps(event).startswith('{"event": "env"')
    alone = environment_event({"CONTROLPLANE_NODE_RANK": "3"})  # without torchrun
    assert (alone["rank"], alone["node_rank"], alone["world_size"], alone["env"]) == (0, 3, 1, {})


def test_the_trainer_reports_the_same_nccl_prefixes_the_control_plane_keeps():
    from apps.jobs.specs import NCCL_ENV_PREFIXES
    from workers.trainer.metrics import NCCL_PREFIXES

    assert set(NCCL_PREFIXES) == set(NCCL_ENV_PREFIXES)


def test_mfu_uses_the_dense_bf16_peak():
    from workers.trainer.metrics import StepMeter

    meter = StepMeter(device=torch.device("cpu"), tokens_per_step=1, flops_per_token=1, gpus=1)
    assert meter.peak is None  # CPUs report mfu as null
    assert not math.isnan(meter.step(step=1, loss=1.0, grad_norm=1.0, lr=1e-3)["tokens_per_s"])


def test_a_report_covers_every_step_since_the_last_one_timed_by_when_their_work_ended():
    from workers.trainer.metrics import StepMeter

    meter = StepMeter(device=torch.device("cpu"), tokens_per_step=1000, flops_per_token=1, gpus=1)
    meter.resume_at(0)
    start = meter._last
    figures = dict(loss=1.0, grad_norm=1.0, lr=1e-3)

    # log_every=10: one report for ten steps of 0.5 s each.
    ten = meter.step(step=10, ended_at=start + 5.0, **figures)
    assert ten["tokens"] == 10_000
    assert ten["tokens_per_s"] == pytest.approx(2000.0)
    assert ten["step_time_s"] == pytest.approx(0.5)

    # The last two steps of a run are reported back to back, long after the first of them
    # ended (on a CPU the next step's work ran before its report): each gets its own time.
    eleven = meter.step(step=11, ended_at=start + 5.5, **figures)
    twelve = meter.step(step=12, ended_at=start + 6.0, **figures)
    assert eleven["step_time_s"] == twelve["step_time_s"] == pytest.approx(0.5)
    assert twelve["tokens"] == 12_000 and twelve["tokens_per_s"] == pytest.approx(2000.0)


def test_a_resumed_run_counts_its_tokens_from_the_step_it_resumes_after():
    from workers.trainer.metrics import StepMeter

    meter = StepMeter(device=torch.device("cpu"), tokens_per_step=1000, flops_per_token=1, gpus=1)
    meter.resume_at(40)
    report = meter.step(step=41, ended_at=meter._last + 0.25, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert report["tokens"] == 41_000
    assert report["tokens_per_s"] == pytest.approx(4000.0)


# --- the S3 copy ---------------------------------------------------------------------------------


def test_a_committed_checkpoint_is_copied_to_s3(tmp_path, aws_endpoint, capsys):
    boto3 = pytest.importorskip("boto3")
    from workers.trainer.checkpoint import copy_to_s3
    from workers.trainer.config import S3Copy

    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    for name, body in {
        "__0_0.distcp": b"shard",
        ".metadata": b"meta",
        "manifest.json": b"{}",
    }.items():
        (checkpoint / name).write_bytes(body)
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="checkpoints")
    target = S3Copy(bucket="checkpoints", prefix="foundation/job-7", endpoint_url=aws_endpoint,
                    region="us-east-1")  # fmt: skip

    copy_to_s3(checkpoint, target, 4)
    paused = []
    missing = S3Copy(bucket="missing", endpoint_url=aws_endpoint)
    copy_to_s3(checkpoint, missing, 4, delays=(5.0, 30.0), sleep=paused.append)

    listed = client.list_objects_v2(Bucket="checkpoints")["Contents"]
    assert {o["Key"] for o in listed} == {
        f"foundation/job-7/step-00000004/{name}"
        for name in ("__0_0.distcp", ".metadata", "manifest.json")
    }
    copied, failed = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert copied["event"] == "checkpoint_copy"
    assert copied["uri"] == "s3://checkpoints/foundation/job-7/step-00000004"
    assert failed["event"] == "checkpoint_copy_failed"
    assert "missing" in failed["uri"] and failed["attempts"] == 3
    assert paused == [5.0, 30.0]  # tried again after each pause before it was reported


def test_an_upload_that_fails_is_tried_again_and_then_reported_once(tmp_path, aws_endpoint, capsys):
    boto3 = pytest.importorskip("boto3")
    from workers.trainer.checkpoint import copy_to_s3
    from workers.trainer.config import S3Copy

    checkpoint = tmp_path / "step-00000008"
    checkpoint.mkdir()
    (checkpoint / "__0_0.distcp").write_bytes(b"shard")
    (checkpoint / "manifest.json").write_bytes(b"{}")
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    bucket = f"late-{tmp_path.name.lower()[-20:]}"

    def pause(seconds):  # the bucket appears while the trainer waits to try again
        client.create_bucket(Bucket=bucket)

    copy_to_s3(checkpoint, S3Copy(bucket=bucket, endpoint_url=aws_endpoint), 8, sleep=pause)

    (report,) = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert report["event"] == "checkpoint_copy" and report["attempts"] == 2
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {"step-00000008/__0_0.distcp", "step-00000008/manifest.json"}


def test_the_flight_recorders_old_names_are_passed_on_under_the_new_ones():
    from workers.trainer.parallelize import use_current_flight_recorder_names

    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_CPP_STACK": "1"}
    use_current_flight_recorder_names(env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_CPP_STACK": "1"}

    both = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "500"}
    use_current_flight_recorder_names(both)
    assert both == {"TORCH_FR_BUFFER_SIZE": "500"}  # the new name wins, as in torch


def test_an_event_with_a_number_json_cannot_hold_prints_null_for_it(capsys):
    """A diverged loss (NaN) or an overflowed perplexity (inf) must not make the line one the
    control plane's strict JSON parser refuses whole (a checkpoint's report with it)."""
    from workers.trainer import metrics

    metrics.emit(
        {
            "event": "checkpoint",
            "step": 3,
            "loss": float("nan"),
            "eval": {"step": 2, "loss": 800.0, "perplexity": float("inf")},
            "layers": [1.0, float("-inf")],
        }
    )
    line = capsys.readouterr().out.strip()
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} printed")) == {
        "event": "checkpoint",
        "step": 3,
        "loss": None,
        "eval": {"step": 2, "loss": 800.0, "perplexity": None},
        "layers": [1.0, None],
    }
