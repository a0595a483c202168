"""Faults on real parts: an agent paused (heartbeats cut), an agent and its job killed (a node
lost for good), a spot notice from a stand-in for EC2 instance metadata, a trainer's rank
killed as the OOM killer or a hardware fault would.

Thresholds are shortened (seconds, not minutes) so each fault plays out in a few seconds;
the sweep is called as its beat would call it.
"""

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.conf import settings

from apps.jobs.dispatch import NO_LONGER_RUN, job_dispatch
from apps.jobs.models import Job, JobEvent, Run, StepMetric
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import ENDED, agent_ledger, tiny_trainer_spec, wait_for, workers_of
from tests.e2e.test_command_jobs import _submit
from workers.agent import exits
from workers.agent.leftovers import LEFT_BY_PREDECESSOR, process_start_time
from workers.tasks.fleet import heartbeat_sweep
from workers.tasks.provisioning import local_nodes_revive, provider_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# Checkpoints on SIGTERM (prints, exits 0): what the bundled trainer does on a stop.
POLITE = (
    "import signal, sys, time\n"
    "def stop(*_): print('checkpoint written', flush=True); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('training', flush=True)\n"
    "time.sleep(600)\n"
)


def _agent_pid(node) -> int:
    node_dir = Path(settings.VAR_DIR) / "nodes" / f"node-{node.uuid}"
    return int((node_dir / "agent.pid").read_text())


def _running_job(api, team, argv) -> Job:
    job = _submit(api, team, argv)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    wait_for("the job to run", lambda: Job.objects.get(pk=job.pk).state == "running")
    return Job.objects.get(pk=job.pk)


def _node_state(node) -> str:
    return type(node).objects.get(pk=node.pk).state


def test_heartbeats_cut_make_the_node_suspect_and_leave_its_job_running(
    local_nodes, e2e_team, api_for, settings
):
    settings.NODE_SUSPECT_AFTER_S = 3
    settings.NODE_DOWN_AFTER_S = 600
    pool = factories.make_owned_pool(slug="e2e-blip")
    (node,) = local_nodes(pool, count=1, gpus=2)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    job = _running_job(api, e2e_team, ["python3", "-c", POLITE])
    pid = _agent_pid(node)
    os.kill(pid, signal.SIGSTOP)  # the agent stops talking; its job goes on
    try:
        wait_for(
            "the node to be suspect",
            lambda: heartbeat_sweep() and _node_state(node) == "suspect",
            timeout_s=30,
            every_s=1.0,
        )
        assert Job.objects.get(pk=job.pk).state == "running"
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(
        "the node to come back",
        lambda: heartbeat_sweep() and _node_state(node) == "busy",
        timeout_s=30,
        every_s=1.0,
    )
    job.refresh_from_db()
    assert job.state == "running" and job.restarts == 0
    assert Run.objects.get(job=job).state == "running"


def test_a_node_lost_for_good_goes_down_and_its_job_is_requeued(
    local_nodes, e2e_team, api_for, settings
):
    settings.NODE_SUSPECT_AFTER_S = 2
    settings.NODE_DOWN_AFTER_S = 5
    pool = factories.make_owned_pool(slug="e2e-lost")
    (node,) = local_nodes(pool, count=1, gpus=2)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    job = _running_job(api, e2e_team, ["python3", "-c", POLITE])
    # The machine is gone: its agent, and its job (whose processes are a session of their own).
    os.killpg(_agent_pid(node), signal.SIGKILL)
    os.killpg(Run.objects.get(job=job).pid, signal.SIGKILL)
    wait_for(
        "the node to be down",
        lambda: heartbeat_sweep() and _node_state(node) == "down",
        timeout_s=40,
        every_s=1.0,
    )
    job.refresh_from_db()
    assert job.state == "pending"
    assert job.restarts == 1
    assert "lost" in JobEvent.objects.filter(job=job).last().reason
    assert Run.objects.get(job=job).state == "lost"
    assert not job.allocations.filter(ended_at__isnull=True).exists()


# A launcher with a worker in a session of its own, as torchrun starts them; both train on.
LAUNCHER = (
    "import subprocess, time\n"
    "subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
    "print('training', flush=True)\n"
    "time.sleep(600)\n"
)


def _tree(pid: int) -> dict[int, int]:
    """The process and its descendants, each with its start time (which names it for good)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
        except (ValueError, OSError, IndexError):
            continue
    tree, grown = {pid}, True
    while grown:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    return {p: t for p in tree if (t := process_start_time(p)) is not None}


def _going(tree: dict[int, int]) -> list[int]:
    return [p for p, t in tree.items() if process_start_time(p) == t]


def test_a_restarted_agent_stops_the_run_its_killed_predecessor_left_and_the_job_is_requeued(
    local_nodes, e2e_team, api_for, settings
):
    pool = factories.make_owned_pool(slug="e2e-successor")
    (node,) = local_nodes(pool, count=1, gpus=2)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    job = _running_job(api, e2e_team, ["python3", "-c", LAUNCHER])
    run = Run.objects.get(job=job)
    tree = wait_for("the launcher's worker", lambda: len(t := _tree(run.pid)) == 2 and t)
    os.kill(_agent_pid(node), signal.SIGKILL)  # the agent alone: its run trains on
    provider, spec = provider_for(node)
    wait_for("the agent to be gone", lambda: not provider.describe(spec).agent_alive)
    time.sleep(1)
    assert _going(tree) == list(tree)  # nothing of the dead agent stops them
    assert local_nodes_revive() == {"restarted": 1}
    revived = time.monotonic()
    wait_for("the old run's processes to be stopped", lambda: not _going(tree), timeout_s=20)
    assert time.monotonic() - revived < 15  # the new agent's first act, a short grace
    run = wait_for(
        "the run to be found lost",
        lambda: heartbeat_sweep() and (r := Run.objects.get(pk=run.pk)).state == "lost" and r,
        timeout_s=60,
        every_s=1.0,
    )
    assert run.reason == NO_LONGER_RUN
    job.refresh_from_db()
    assert job.state == "pending" and job.restarts == 1
    assert "was lost" in JobEvent.objects.filter(job=job).last().reason
    lines = [r for r in agent_ledger(node) if r["run"] == run.pk]
    assert [r["event"] for r in lines] == ["started", "ended"]
    assert lines[1]["reason"] == LEFT_BY_PREDECESSOR


class _Metadata:
    """A stand-in for EC2 instance metadata (IMDSv2) on 127.0.0.1."""

    def __init__(self):
        self.notice = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"imds-token")

            def do_GET(self):
                ok = self.headers.get("X-aws-ec2-metadata-token") == "imds-token"
                if not ok or outer.notice is None or not self.path.endswith("instance-action"):
                    self.send_response(404 if ok else 401)
                    self.end_headers()
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(json.dumps(outer.notice).encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_spot_notice_signals_the_job_which_checkpoints_and_is_requeued(
    agents_reach, local_nodes, e2e_team, api_for, settings
):
    metadata = _Metadata()
    settings.AGENT_IMDS_URL = metadata.url
    settings.AGENT_SPOT_POLL_S = 1
    try:
        pool = factories.make_owned_pool(slug="e2e-spot")
        (node,) = local_nodes(pool, count=1, gpus=2)
        api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
        job = _running_job(api, e2e_team, ["python3", "-c", POLITE])
        metadata.notice = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}
        job = wait_for(
            "the job to be requeued",
            lambda: (j := Job.objects.get(pk=job.pk)).state == "pending" and j,
            timeout_s=60,
        )
    finally:
        metadata.close()
    states = list(JobEvent.objects.filter(job=job).values_list("to_state", flat=True))
    assert states[-2:] == ["preempting", "pending"]
    assert job.restarts == 1  # an infrastructure fault, counted against the restart limit
    run = Run.objects.get(job=job)
    assert run.exit_code == 0 and run.reason == "spot interruption"  # it checkpointed and left
    node.refresh_from_db()
    assert node.interrupted_at is not None
    assert node.state in ("draining", "drained")  # no new work on a node about to go away
    wait_for(
        "the job's last words",
        lambda: (
            "checkpoint written"
            in [line["text"] for line in api.get(f"/api/v1/jobs/{job.pk}/logs/").json()["lines"]]
        ),
    )


def test_a_rank_killed_by_sigkill_requeues_the_trainer_job_naming_that_rank(
    local_nodes, e2e_team, api_for
):
    """torchrun exits 1 when a rank dies, whatever killed it; the agent's exit watch (the
    kernel's process events) says rank 1 was killed by SIGKILL, so the job is requeued as
    the node's fault, not failed as the job's."""
    if reason := exits.unavailable():
        pytest.skip(f"the agent's exit watch cannot run here: {reason}")
    pool = factories.make_owned_pool(slug="e2e-killed-rank")
    (node,) = local_nodes(pool, count=1, gpus=2)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    spec = tiny_trainer_spec(e2e_team, nodes=1, gpus_per_node=2, steps=2000)
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    wait_for(
        "the job to train",
        lambda: StepMetric.objects.filter(job=job, attempt=1, step__gte=2).exists(),
        timeout_s=180,
    )
    run = Run.objects.get(job=job, attempt=1)
    workers = workers_of(run.pid)
    assert [w.rank for w in workers] == [0, 1]
    victim = workers[1]
    os.kill(victim.pid, signal.SIGKILL)

    job = wait_for(
        "the job to be requeued",
        lambda: (j := Job.objects.get(pk=job.pk)).state in ("pending", *ENDED) and j,
        timeout_s=120,
    )
    run.refresh_from_db()
    assert run.state == "exited" and run.exit_code == 1, (run.state, run.exit_code, run.signal)
    assert run.evidence["kind"] == "signal" and run.evidence["signal"] == 9, run.evidence
    assert (run.evidence["pid"], run.evidence["rank"]) == (victim.pid, 1), run.evidence
    assert (job.state, job.restarts) == ("pending", 1), job.state_reason
    event = JobEvent.objects.filter(job=job).order_by("at").last()
    assert event.to_state == "pending"
    assert event.reason == (
        f"requeued: rank 1 (pid {victim.pid}) on {node.name} was killed by signal 9 (SIGKILL) "
        "(infrastructure)"
    )
