"""A trainer job running on the jobs tests' small fleet, checkpoint directories written as the
trainer writes them, and the node agent's real checkpoint code talking to the control plane
through Django's test client (the same endpoints, node token and answers as over HTTP)."""

import hashlib
import json
from pathlib import Path

import pytest
from django.test import Client

from apps.fleet.agents import node_agent_token_issue
from apps.jobs import services as jobs
from apps.jobs.dispatch import job_dispatch, run_report
from apps.jobs.models import Job, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs import conftest as jobs_fixtures
from tests.apps.jobs.conftest import trainer_spec
from tests.workers import conftest as workers_fixtures
from workers.agent.checkpoints import CheckpointKeeper
from workers.agent.client import Refused, Unreachable

fleet_pool = jobs_fixtures.fleet_pool
quota = jobs_fixtures.quota
moto_endpoint = workers_fixtures.moto_endpoint
aws_endpoint = workers_fixtures.aws_endpoint


@pytest.fixture(autouse=True)
def agents_never_idle(monkeypatch):
    """Test transactions never commit, so the marks that wake an idle agent never land: the
    "nothing for this node" cache is off here (test_agent_work turns it on)."""
    from apps.checkpoints.selectors import agent_idle

    monkeypatch.setattr(agent_idle, "max_timeout_s", 0)


@pytest.fixture(autouse=True)
def checkpoint_root(settings, tmp_path) -> Path:
    settings.CHECKPOINT_ROOT = str(tmp_path / "checkpoints")
    settings.CHECKPOINT_ROOT_SHARED = True
    settings.CHECKPOINT_S3_BUCKET = ""
    return Path(settings.CHECKPOINT_ROOT)


def submit_trainer(team, user, **trainer) -> Job:
    spec = trainer_spec(
        team,
        preset="tiny",
        nodes=1,
        gpus_per_node=8,
        layout={"dp_shard": 8},
        seq_len=256,
        **{"steps": 100, "checkpoint_every_steps": 10, **trainer},
    )
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=user)
    return job


def start(job: Job, **dispatch) -> Run:
    """Place and dispatch the job, and report its run started, as its agent would."""
    scheduling_pass()
    job_dispatch(job_id=job.pk, **dispatch)
    run = Run.objects.filter(job=job).order_by("-attempt").first()
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 4242})
    return run


@pytest.fixture
def running_job(fleet_pool, quota, team, researcher) -> Job:
    job = submit_trainer(team, researcher)
    start(job)
    return Job.objects.get(pk=job.pk)


def write_checkpoint(
    directory: Path, step: int, *, job: Job | None = None, attempt: int = 1, name: str = ""
) -> tuple[Path, str]:
    """A committed checkpoint as the trainer lays it out: shards, .metadata, then the manifest
    with each file's size and SHA-256. Returns its path and the manifest's SHA-256."""
    path = directory / (name or f"step-{step:08d}")
    path.mkdir(parents=True)
    files = {}
    for file_name, body in {
        "__0_0.distcp": f"rank 0 shard of step {step} ".encode() * 64,
        "__1_0.distcp": f"rank 1 shard of step {step} ".encode() * 64,
        ".metadata": b"dcp metadata",
    }.items():
        (path / file_name).write_bytes(body)
        files[file_name] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    manifest = {
        "format": 1,
        "step": step,
        "loss": 5.0 - step / 100,
        "time": 1.8e9 + step,
        "world_size": 8,
        "layout": {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1},
        "files": files,
        "job": {"id": job.pk, "uuid": str(job.uuid), "attempt": attempt} if job else {},
    }
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (path / "manifest.json").write_bytes(body)
    return path, hashlib.sha256(body).hexdigest()


def commit_event(path: Path, digest: str, step: int, **extra) -> dict:
    """The trainer's line for a committed checkpoint (workers/trainer/checkpoint.py)."""
    size = sum(f.stat().st_size for f in path.iterdir())
    return {
        "event": "checkpoint",
        "step": step,
        "path": str(path.resolve()),
        "manifest_sha256": digest,
        "size_bytes": size,
        "world_size": 8,
        "layout": {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1},
        "loss": 5.0 - step / 100,
        "time": 1.8e9 + step,
        "files": 4,
        **extra,
    }


class AgentBridge:
    """workers.agent.client.ControlPlane's call(), answered by Django's test client."""

    def __init__(self, node):
        self.node = node
        self._auth = f"Bearer {node_agent_token_issue(node=node)}"
        self._client = Client()

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        if method == "GET":
            answer = self._client.get(path, HTTP_AUTHORIZATION=self._auth)
        else:
            answer = self._client.post(
                path,
                data=json.dumps(body or {}),
                content_type="application/json",
                HTTP_AUTHORIZATION=self._auth,
            )
        text = answer.content.decode()
        if answer.status_code >= 500:
            raise Unreachable(f"HTTP {answer.status_code}")
        if answer.status_code >= 400:
            raise Refused(answer.status_code, text)
        return json.loads(text) if text.strip() else {}


class DirectOutbox:
    """An outbox that sends at once (the real one retries from a thread)."""

    def __init__(self, control):
        self.control = control
        self.refused: list[tuple] = []

    def put(self, message) -> None:
        try:
            self.control.call(message.method, message.path, message.body)
        except Refused as exc:
            self.refused.append((message.what, exc.status))


def agent_of(node) -> CheckpointKeeper:
    """The node's agent, as far as checkpoints go: its real CheckpointKeeper."""
    bridge = AgentBridge(node)
    return CheckpointKeeper(bridge, DirectOutbox(bridge))


def report(keeper: CheckpointKeeper, run: Run, event: dict) -> None:
    """The trainer printed `event`; the agent relays it."""
    keeper.relay(run.pk, json.dumps(event, separators=(",", ":")))
