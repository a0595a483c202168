"""The whole path on real parts: the live server, local nodes whose agents are real
processes, the scheduler's pass and the dispatch service called as their tasks would."""

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from apps.accounts import services as accounts
from apps.fleet.models import Node
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, JobEvent, Run, StepMetric
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.jobspecs import tiny_trainer_spec  # noqa: F401 (the e2e tests' own names)
from tests.procs import Worker, wait_for, workers_of  # noqa: F401 (the e2e tests' own names)
from workers.tasks.provisioning import provider_for, provision_node, terminate_node

ENDED = ("succeeded", "failed", "cancelled")


@pytest.fixture
def open_dir():
    """A scratch folder other users may pass through (pytest's own tmp_path is closed to
    them): local nodes started by root run each job as its own unprivileged user, which
    must reach its run directory and checkpoints under here."""
    path = Path(tempfile.mkdtemp(prefix="cp-e2e-", dir="/tmp"))
    os.chmod(path, 0o711)  # noqa: S103 (pass through, list nothing)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agents_reach(live_server, settings, open_dir):
    """Agents call the live server; local nodes and checkpoints live under a scratch folder."""
    settings.CONTROLPLANE_URL = live_server.url
    settings.VAR_DIR = open_dir
    settings.CHECKPOINT_ROOT = str(open_dir / "checkpoints")
    settings.AGENT_HEARTBEAT_S = 1
    settings.NODE_MIN_FREE_DISK_GB = 0
    # No beat runs here to write the agents' heartbeats to the database, so the scheduler
    # would soon see every node as one that stopped answering: tests that need that rule
    # run the sweep themselves and set this.
    settings.NODE_QUIET_AFTER_S = 3600
    return live_server


@pytest.fixture
def local_nodes(agents_reach):
    """`local_nodes(pool, count, gpus)`: local nodes brought up to READY by their real agents."""
    with _node_maker() as up:
        yield lambda pool, count=1, gpus=2: up(
            [factories.make_node(pool=pool, provider="local", gpu_count=gpus) for _ in range(count)]
        )


@contextlib.contextmanager
def _node_maker():
    """`up(nodes)`: provision nodes, wait for their agents to register (READY); every node
    brought up is terminated at the end (a test may have taken one down itself)."""
    made = []

    def up(nodes):
        for node in nodes:
            provision_node(node.pk)
            made.append(node.pk)
        for node in nodes:
            wait_for(
                f"{node.name} to register",
                lambda node=node: Node.objects.get(pk=node.pk).state == "ready",
            )
        return nodes

    try:
        yield up
    finally:
        for node_id in made:
            with contextlib.suppress(Exception):
                terminate_node(node_id)


@pytest.fixture
def e2e_team(db):
    team = factories.make_team(slug="e2e")
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    return team


@pytest.fixture
def ssh_nodes(agents_reach, ssh_server, client_key, settings, open_dir):
    """`ssh_nodes(pool, count)`: owned nodes reached over a real sshd on 127.0.0.1 (its
    host key pinned, as ops would have accepted it), brought up to READY by their agents,
    which run as the sshd's user (root in CI) with a stand-in nvidia-smi of 4 GPUs."""
    from tests.workers.providers.servers import FAKE_NVIDIA_SMI, public_key
    from workers.providers.bundle import NODE_UUID_VARIABLE

    settings.SSH_KEY_FILE = str(client_key)
    settings.SSH_NODE_ROOT = str(open_dir / "ssh-nodes")
    # The nodes' Python with torch in it, as a GPU host's image would have one.
    settings.SSH_NODE_PYTHON = sys.executable
    fake = ssh_server.fakebin / "nvidia-smi"
    # GPU UUIDs are unique across the fleet: each node's agent (which has its node's UUID in
    # its environment) reports GPUs of its own, as two machines behind the one sshd would.
    per_node = "-${" + NODE_UUID_VARIABLE + ":-e2e},"
    fake.write_text(FAKE_NVIDIA_SMI.replace("-e2e,", per_node))
    fake.chmod(0o755)

    def make(pool, count: int = 1):
        return up(
            [
                factories.make_node(
                    pool=pool,
                    provider="ssh",
                    address="127.0.0.1",
                    ssh_port=ssh_server.port,
                    ssh_user=ssh_server.user,
                    host_key=public_key(ssh_server.host_key),
                    gpu_count=4,
                )
                for _ in range(count)
            ]
        )

    with _node_maker() as up:
        yield make
    fake.unlink(missing_ok=True)


# --- trainer jobs ------------------------------------------------------------------------


@dataclass
class Finished:
    """A job run to its end, with what a test or the closing note reads of it."""

    job: Job
    wall_s: float  # submitted → finished, as the job's own timestamps say
    runs: list[Run]

    def losses(self) -> dict[int, float]:
        """Step → loss as the trainer reported it (rank 0's line, the world's mean)."""
        return dict(
            StepMetric.objects.filter(job=self.job, attempt=1)
            .order_by("step")
            .values_list("step", "loss")
        )


def trainer_job_run(api, spec: dict, *, while_running=None, timeout_s: float = 300) -> Finished:
    """Submit through the API, schedule, dispatch, and wait for the job to finish.

    `while_running(job)`, if given, is called once the job is RUNNING (every node's torchrun
    has started) and may watch its processes; what it returns is ignored."""
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == "admitted", job.pending_reason
    job_dispatch(job_id=job.pk)
    try:
        if while_running is not None:
            wait_for(
                f"job {job.pk} to run",
                lambda: Job.objects.get(pk=job.pk).state in ("running", *ENDED),
                timeout_s=timeout_s,
            )
            while_running(job)
        job = wait_for(
            f"job {job.pk} to finish",
            lambda: (j := Job.objects.get(pk=job.pk)).state in ENDED and j,
            timeout_s=timeout_s,
            every_s=0.5,
        )
    except AssertionError as error:
        # Where it stood, so that a slow machine's timeout says what was slow.
        job.refresh_from_db()
        runs = list(Run.objects.filter(job=job).values("node_id", "state", "pid", "reason"))
        events = list(JobEvent.objects.filter(job=job).values_list("to_state", "reason"))
        time.sleep(3)  # the agents relay output apart from the exit, a moment later
        output = list(job.log_lines.order_by("-at", "-seq").values_list("text", flat=True)[:20])
        raise AssertionError(
            f"{error}: job {job.pk} {job.state} {events} {runs}; its last output, newest "
            f"first: {output}"
        ) from None
    runs = list(Run.objects.filter(job=job).order_by("attempt", "node_rank"))
    return Finished(job, (job.finished_at - job.submitted_at).total_seconds(), runs)


def log_texts(api, job: Job) -> list[str]:
    answer = api.get(f"/api/v1/jobs/{job.pk}/logs/")
    assert answer.status_code == 200, answer.content
    return [line["text"] for line in answer.json()["lines"]]


def node_directory(node: Node) -> Path:
    """The node's directory, where its agent keeps its files: local and SSH nodes are both
    directories of this machine here."""
    provider, spec = provider_for(node)
    return Path(provider.node_dir(spec))


def run_directory(run: Run) -> Path:
    """The run's directory on its node (run.json, status.json, tmp/), as the agent made it."""
    return node_directory(run.node) / "runs" / f"run-{run.pk}"


def agent_ledger(node: Node) -> list[dict]:
    """The node agent's own record of the runs it started and saw end (runs.jsonl)."""
    from workers.agent.agent import LEDGER_FILE
    from workers.agent.runs import Ledger

    return Ledger(node_directory(node) / LEDGER_FILE).read()
