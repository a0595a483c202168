"""The trainer under torchrun on the CPU (gloo), as the local nodes run it: layouts, stops, resumes.

Every run trains the `tiny` preset for STEPS steps on one token file (made by
prepare.py from generated text) with the same seed, global batch and
schedule; runs are compared step by step on the loss they print.

Tolerances: losses within LOSS_TOLERANCE (1e-3, absolute, on losses from 5.5
down to about 4) at every step, and the first step's gradient norm within
NORM_TOLERANCE (1e-5, relative). Every layout computes the same function in
fp32; what differs is the order of additions (shards reduced by gloo, split
matrix products). That moves the first gradient norm by about 1e-7, and the
losses by 1e-6 to 1e-4 after a few steps, since Adam's first updates are
nearly lr·sign(gradient) and a coordinate whose gradient is almost zero can
flip. A shard initialised differently or a batch taken twice moves the losses
by 1e-2 or more; a gradient off by a factor (which Adam would hide in the
losses) shows in the norm.

The processes are few and the steps short: the machine running CI may have
two cores for all of it.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from workers.trainer import memory, metrics  # noqa: E402
from workers.trainer.config import parse as run_parse  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STEPS = 6
LOSS_TOLERANCE = 1e-3
NORM_TOLERANCE = 1e-5

pytestmark = pytest.mark.slow


@dataclass
class Run:
    returncode: int
    events: list[dict]
    status: dict | None
    output: str

    @property
    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step"}

    @property
    def grad_norms(self) -> dict[int, float]:
        return {e["step"]: e["grad_norm"] for e in self.events if e["event"] == "step"}

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def run_config(dataset: Path, *, layout=None, checkpoint=None, steps=STEPS, **extra) -> dict:
    return {
        "model": {"preset": "tiny"},
        "data": {"dataset": str(dataset), "seq_len": 32},
        # Constant after warm-up (no decay): a step's learning rate does not depend on
        # how many steps the run was asked for.
        "schedule": {
            "steps": steps,
            "global_batch": 8,
            "lr": 3e-3,
            "warmup_steps": 2,
            "min_lr_ratio": 1.0,
        },
        "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **(layout or {})},
        "checkpoint": checkpoint or {},
        **extra,
    }


def launch(config: dict, workdir: Path, *, nproc: int, env=None) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.json").write_text(json.dumps(config))
    env = {
        **os.environ,
        "CONTROLPLANE_STATUS_FILE": str(workdir / "status.json"),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU, also on a machine with GPUs
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    if nproc == 1:  # the trainer on its own makes a world of one
        command = [sys.executable, "-m", "workers.trainer", "--config", "run.json"]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "workers.trainer",
            "--config",
            "run.json",
        ]
    # Its own session, as the node agent starts it: a stop signals every process in it.
    return subprocess.Popen(
        command,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, workdir: Path, lines: list[str] | None = None) -> Run:
    rest, _ = process.communicate(timeout=300)
    output = "".join(lines or []) + rest
    events = [json.loads(line) for line in output.splitlines() if line.startswith('{"event"')]
    status_file = workdir / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else None
    return Run(process.returncode, events, status, output)


def train(config: dict, workdir: Path, *, nproc: int = 1, env=None) -> Run:
    run = finish(launch(config, workdir, nproc=nproc, env=env), workdir)
    assert run.returncode == 0, run.output[-3000:]
    return run


def assert_same_losses(run: Run, reference: Run, steps) -> None:
    for step in steps:
        assert abs(run.losses[step] - reference.losses[step]) <= LOSS_TOLERANCE, (
            f"step {step}: {run.losses[step]} against {reference.losses[step]}"
        )


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def dataset(scratch) -> Path:
    from workers.trainer.prepare import prepare

    texts = scratch / "texts"
    texts.mkdir()
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "tired",
        "owls",
        "count",
        "stars",
    ]
    for n in range(4):
        lines = [" ".join(words[(i * 7 + n) % len(words) :] + words[: i % 5]) for i in range(60)]
        (texts / f"doc{n}.txt").write_text("\n".join(lines))
    out = scratch / "tokens.bin"
    prepare([texts], out, tokenizer="bytes")
    return out


@pytest.fixture(scope="module")
def reference(scratch, dataset) -> Run:
    """One process, no parallelism: the curve every layout must reproduce."""
    run = train(run_config(dataset), scratch / "reference")
    assert set(run.losses) == set(range(1, STEPS + 1))
    assert run.losses[STEPS] < run.losses[1]  # it learns
    return run


def test_flight_recorder_settings_under_their_old_names_reach_torch_without_warnings(
    scratch, dataset
):
    """NCCL profiles set the flight recorder's old names (older torches read only those);
    this torch reads TORCH_FR_* first and, on every rank, warns about the old ones."""
    old_names = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "64", "TORCH_NCCL_TRACE_CPP_STACK": "0"}
    config = run_config(dataset, layout={"dp_shard": 2}, steps=2)
    run = train(config, scratch / "flight-recorder", nproc=2, env=old_names)
    assert "is deprecated" not in run.output
    # Every rank reports the names it started with, before the trainer passed them on.
    inherited = {k: v for k, v in os.environ.items() if k.startswith(metrics.NCCL_PREFIXES)}
    # torchrun sets this one itself when it is not given.
    handling = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    }
    reports = sorted(run.of("env"), key=lambda e: e["rank"])
    assert [(e["rank"], e["local_rank"], e["node_rank"], e["world_size"]) for e in reports] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    assert all(e["env"] == {**inherited, **handling, **old_names} for e in reports)


def test_every_step_report_counts_its_own_tokens_and_time(reference):
    steps = reference.of("step")
    per_step = steps[0]["tokens"]
    assert per_step > 0
    assert [e["tokens"] for e in steps] == [e["step"] * per_step for e in steps]
    # The last step is reported right after the one before it; on the CPU its work ran
    # before either report. Timed from the report, it took next to nothing (a rate a
    # thousand times the others' on the job's chart).
    times = sorted(e["step_time_s"] for e in steps[1:-1])
    assert steps[-1]["step_time_s"] > times[len(times) // 2] / 10


LAYOUTS = {
    "ddp": ({"dp_replicate": 2}, {}),
    "fsdp": ({"dp_shard": 2}, {"activation_checkpointing": "selective"}),
    "tp": ({"tp": 2}, {}),
    "pp-1f1b": ({"pp": 2}, {}),
    "pp-interleaved": (
        {"pp": 2},
        {"pipeline": {"schedule": "interleaved_1f1b"}, "activation_checkpointing": "full"},
    ),
    "fsdp-x-tp": ({"dp_shard": 2, "tp": 2}, {}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_trains_to_the_same_losses(name, scratch, dataset, reference):
    layout, extra = LAYOUTS[name]
    nproc = 1
    for size in layout.values():
        nproc *= size

    run = train(run_config(dataset, layout=layout, **extra), scratch / name, nproc=nproc)

    assert_same_losses(run, reference, range(1, STEPS + 1))
    assert run.grad_norms[1] == pytest.approx(reference.grad_norms[1], rel=NORM_TOLERANCE)
    assert run.status["reason"] == "finished"
    (start,) = run.of("start")
    assert start["layout"]["dp_shard"] == layout.get("dp_shard", 1)
    assert start["world_size"] == nproc
    # The memory model's sharded lines are exact: rank 0's share of the fp32 state.
    (states,) = run.of("state_bytes")
    config = run_config(dataset, layout=layout, **extra)
    predicted = memory.estimate_ranks(run_parse(config), gpu=False)[0].states
    assert {k: states[k] for k in predicted} == predicted


@pytest.fixture(scope="module")
def preempted(scratch, dataset) -> tuple[Run, Path]:
    """FSDP on two processes, checkpointing every 2 steps, sent SIGTERM once step 2 is reported.

    The signal arrives while step 2's checkpoint is written; a stop voted at a
    step lands after the next one (the trainer reads each vote a step late), so
    it stops after step 4, short of the reference's 6.

    It is asked for 200 steps, so only the signal ends it early; the learning
    rate is constant after warm-up, so its steps are the reference's. The
    signal goes to the whole process group, as the node agent sends it: the
    workers get it directly, and so does torchrun.
    """
    workdir = scratch / "preempted"
    config = run_config(
        dataset,
        layout={"dp_shard": 2},
        checkpoint={"dir": str(workdir / "checkpoints"), "every_steps": 2},
        steps=200,
    )
    process = launch(config, workdir, nproc=2)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith('{"event":"step","step":2,'):
            break
    os.killpg(process.pid, signal.SIGTERM)
    return finish(process, workdir, lines), workdir / "checkpoints"


def copy_of(checkpoints: Path, where: Path) -> Path:
    """A private copy of a run's checkpoints, so each test resumes from the same ones."""
    shutil.copytree(checkpoints, where)
    return where


def test_sigterm_mid_run_commits_a_checkpoint_and_reports_preempted(preempted, reference):
    run, checkpoints = preempted

    assert run.status["reason"] == "preempted", run.output[-3000:]
    stopped_at = run.status["step"]
    assert 3 <= stopped_at < STEPS
    assert [e["step"] for e in run.of("checkpoint")][-1] == stopped_at
    assert run.of("end")[0]["reason"] == "preempted"
    manifest = json.loads((checkpoints / f"step-{stopped_at:08d}" / "manifest.json").read_text())
    assert manifest["step"] == stopped_at
    assert manifest["world_size"] == 2
    assert manifest["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}
    assert manifest["data"]["samples_seen"] == stopped_at * 8
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"].values())
    assert not list(checkpoints.glob(".tmp-*"))
    assert_same_losses(run, reference, range(1, stopped_at + 1))


def test_stopping_and_resuming_gives_the_uninterrupted_curve(
    scratch, dataset, reference, preempted
):
    stopped, checkpoints = preempted
    stopped_at = stopped.status["step"]
    workdir = scratch / "resumed"
    config = run_config(
        dataset,
        layout={"dp_shard": 2},
        checkpoint={"dir": str(copy_of(checkpoints, workdir / "checkpoints"))},
    )

    run = train(config, workdir, nproc=2)

    (resume,) = run.of("resume")
    assert resume["step"] == stopped_at
    assert set(run.losses) == set(range(stopped_at + 1, STEPS + 1))
    per_step = reference.of("step")[0]["tokens"]
    assert [e["tokens"] for e in run.of("step")] == [e["step"] * per_step for e in run.of("step")]
    assert_same_losses(run, reference, range(stopped_at + 1, STEPS + 1))
    assert run.status["reason"] == "finished"


def test_a_checkpoint_resumes_on_another_layout(scratch, dataset, reference, preempted):
    stopped, checkpoints = preempted
    stopped_at = stopped.status["step"]
    workdir = scratch / "relayout"
    config = run_config(
        dataset,
        layout={"tp": 2},
        checkpoint={"dir": str(copy_of(checkpoints, workdir / "checkpoints"))},
    )

    run = train(config, workdir, nproc=2)

    (resume,) = run.of("resume")
    assert resume["from_layout"]["dp_shard"] == 2
    assert resume["layout"]["tp"] == 2
    assert_same_losses(run, reference, range(stopped_at + 1, STEPS + 1))
    # Its own checkpoint records the layout that wrote it.
    assert run.of("checkpoint")[-1]["layout"]["tp"] == 2


def test_a_checkpoint_resumes_on_half_the_ranks_with_the_same_global_batch(
    scratch, dataset, reference, preempted
):
    """As a job with a node range resumes on fewer nodes (apps/jobs/runconfig.layout_on):
    FSDP over two ranks wrote the checkpoint, one rank takes it up with dp_shard 1, and
    the global batch stays, each rank's share of it doubled."""
    stopped, checkpoints = preempted
    stopped_at = stopped.status["step"]
    workdir = scratch / "fewer-ranks"
    config = run_config(
        dataset, checkpoint={"dir": str(copy_of(checkpoints, workdir / "checkpoints"))}
    )

    run = train(config, workdir)

    (resume,) = run.of("resume")
    assert (resume["from_world_size"], resume["from_layout"]["dp_shard"]) == (2, 2)
    assert (resume["step"], resume["layout"]["dp_shard"]) == (stopped_at, 1)
    assert run.of("start")[0]["world_size"] == 1
    per_step = reference.of("step")[0]["tokens"]
    assert [e["tokens"] for e in run.of("step")] == [e["step"] * per_step for e in run.of("step")]
    assert_same_losses(run, reference, range(stopped_at + 1, STEPS + 1))


def test_a_corrupted_checkpoint_is_detected_and_the_previous_one_used(
    scratch, dataset, reference, preempted
):
    stopped, checkpoints = preempted
    workdir = scratch / "corrupted"
    copied = copy_of(checkpoints, workdir / "checkpoints")
    newest = copied / f"step-{stopped.status['step']:08d}"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, the size unchanged
    shard.write_bytes(bytes(data))

    run = train(run_config(dataset, checkpoint={"dir": str(copied)}), workdir)

    (rejected,) = run.of("checkpoint_rejected")
    assert rejected["path"].endswith(newest.name)
    assert "SHA-256" in rejected["reason"]
    (resume,) = run.of("resume")
    assert resume["step"] == 2
    assert_same_losses(run, reference, range(3, STEPS + 1))


# --- the control plane's choices: a named S3 copy, no picking of its own ------------------------


def test_a_named_s3_copy_is_fetched_then_resumed(
    scratch, dataset, reference, preempted, aws_endpoint
):
    import boto3

    from workers.trainer.checkpoint import copy_to_s3, sha256_of
    from workers.trainer.config import S3Copy

    stopped, checkpoints = preempted
    stopped_at = stopped.status["step"]
    newest = checkpoints / f"step-{stopped_at:08d}"
    boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1").create_bucket(
        Bucket="resume"
    )
    s3 = {
        "bucket": "resume",
        "prefix": "t/job-1",
        "endpoint_url": aws_endpoint,
        "region": "us-east-1",
    }
    copy_to_s3(newest, S3Copy(**s3), stopped_at)
    workdir = scratch / "from-s3"
    config = run_config(  # one process: another layout than the two that wrote it
        dataset,
        checkpoint={
            "dir": str(workdir / "checkpoints"),  # empty: another node's disk
            "resume_from": f"s3://resume/t/job-1/{newest.name}",
            "resume_newest": False,
            "s3": s3,
        },
    )

    run = train(config, workdir)

    (fetched,) = run.of("checkpoint_fetched")
    assert fetched["manifest_sha256"] == sha256_of(newest / "manifest.json")
    assert fetched["path"] == str((workdir / "checkpoints" / newest.name).resolve())
    (resume,) = run.of("resume")
    assert resume["step"] == stopped_at and resume["path"] == fetched["path"]
    assert_same_losses(run, reference, range(stopped_at + 1, STEPS + 1))


def test_without_a_named_checkpoint_it_starts_over_and_says_which_step_it_moved_aside(
    scratch, dataset, reference, preempted
):
    _, checkpoints = preempted
    workdir = scratch / "told-none"
    config = run_config(
        dataset,
        checkpoint={
            "dir": str(copy_of(checkpoints, workdir / "checkpoints")),
            "every_steps": 2,
            "resume_newest": False,
            "keep": 0,
        },
    )

    run = train(config, workdir)

    assert not run.of("resume")  # checkpoints were there, but none was named
    assert_same_losses(run, reference, range(1, STEPS + 1))
    saved_again = run.of("checkpoint")[0]
    assert saved_again["step"] == 2
    aside = saved_again["replaced"]
    assert ".replaced-step-00000002-" in aside
    assert json.loads((Path(aside) / "manifest.json").read_text())["step"] == 2


# --- a full disk: refused before writing, or cleaned up after failing; never blamed on the job ----


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own, so a test can fill it for real; resized with remount()."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_disk_without_room_refuses_the_save_and_reports_storage(scratch, dataset, small_disk):
    checkpoints = small_disk / "checkpoints"
    checkpoint = {"dir": str(checkpoints), "every_steps": 2}
    train(run_config(dataset, checkpoint=checkpoint, steps=2), scratch / "room-first")
    (kept,) = [p.name for p in checkpoints.iterdir()]
    before = files_of(checkpoints / kept)
    size = sum(len(body) for body in before.values())
    used = os.statvfs(small_disk)
    used_bytes = (used.f_blocks - used.f_bfree) * used.f_frsize
    # Room for half of another checkpoint like it: too little, before a byte is written.
    remount(small_disk, f"size={used_bytes + size // 2}")

    workdir = scratch / "room-refused"
    config = run_config(dataset, checkpoint=checkpoint, steps=4, layout={"dp_shard": 2})
    run = finish(launch(config, workdir, nproc=2), workdir)

    assert run.returncode != 0
    assert run.status["reason"] == "storage", run.output[-3000:]
    pattern = rf"checkpoint: needs \d+\.\d GB at {checkpoints}, \d+\.\d GB free"
    assert re.fullmatch(pattern, run.status["message"]), run.status["message"]
    (failed,) = run.of("checkpoint_failed")
    assert failed["step"] == 4 and failed["message"] == run.status["message"]
    assert [p.name for p in checkpoints.iterdir()] == [kept]  # no temporary left
    assert files_of(checkpoints / kept) == before


def test_a_save_that_fails_on_storage_part_way_removes_only_its_own_temporary(
    scratch, dataset, small_disk
):
    checkpoints = small_disk / "checkpoints"
    checkpoint = {"dir": str(checkpoints), "every_steps": 2}
    train(run_config(dataset, checkpoint=checkpoint, steps=2), scratch / "inodes-first")
    (kept,) = [p.name for p in checkpoints.iterdir()]
    before = files_of(checkpoints / kept)
    # Bytes to spare but one inode left: the temporary directory is made, its first shard
    # file is not (ENOSPC), after the check on free bytes has passed.
    stats = os.statvfs(small_disk)
    remount(small_disk, f"nr_inodes={stats.f_files - stats.f_ffree + 1}")

    workdir = scratch / "inodes-failed"
    run = finish(
        launch(run_config(dataset, checkpoint=checkpoint, steps=4), workdir, nproc=1), workdir
    )

    assert run.returncode != 0
    assert run.status["reason"] == "storage", run.output[-3000:]
    assert run.status["message"].startswith(
        f"checkpoint: step 4 could not be written to {checkpoints}"
    )
    assert "No space left on device" in run.status["message"]
    assert [p.name for p in checkpoints.iterdir()] == [kept]  # .tmp-step-00000004 removed
    assert files_of(checkpoints / kept) == before
