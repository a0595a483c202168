"""Drills on the nodes: an agent killed and started again, a trainer rank killed (and its
newest checkpoint found truncated on resume), a draining node whose agent dies, a node
that stops answering, an SSH node lost in the middle of a two-node job, and a disk that
fills during a checkpoint. Each asserts that the job's states and events say what really
happened, that no process outlives its run, and how long the product took to recover."""

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.drills import checks
from tests.drills.jobs import (
    agent_pid,
    alive,
    checkpoints_committed,
    command,
    only_on,
    run_of,
    submit,
    task_call,
    trainer,
)
from tests.procs import wait_for, workers_of

TIGHT_KIB = 6144  # room for one checkpoint of the tiny trainer (3.8 MB), not two


def _training(drill, job_id: int, *, checkpoints: int = 1, attempt: int = 1) -> dict:
    """Wait until the job's attempt runs and has committed `checkpoints` checkpoints."""
    checks.in_state(drill, job_id, "running", timeout_s=120)
    wait_for(
        f"job {job_id} to commit {checkpoints} checkpoint(s)",
        lambda: len(checkpoints_committed(drill, job_id)) >= checkpoints,
        timeout_s=120,
    )
    return run_of(drill, job_id, attempt=attempt)


def _running_again(drill, job_id: int, attempt: int) -> float:
    wait_for(
        f"attempt {attempt} of job {job_id} to run",
        lambda: (
            checks.job(drill, job_id)["state"] == "running"
            and any(r["attempt"] == attempt for r in checks.runs(drill, job_id))
        ),
        timeout_s=120,
        every_s=0.2,
    )
    return time.monotonic()


def _reasons(drill, job_id: int) -> list[str]:
    return [reason for _, _, reason in checks.events(drill, job_id)]


def test_agent_killed_and_started_again(drill, recovered):
    """kill -9 of a local node's agent while its trainer job runs; the agent is started again
    (fleet.local_nodes_revive, as after a restart of the machine's services). The new agent
    stops the processes its predecessor left, the run is lost, the job is requeued and
    resumes from its checkpoint; the agent's ledger balances."""
    with only_on(drill, "local-1") as (node_id,):
        job_id = submit(drill, trainer(drill, steps=400))
        run = _training(drill, job_id)
        torchrun = run["pid"]
        agent = agent_pid(drill, node_id)
        os.kill(agent, signal.SIGKILL)
        killed = time.monotonic()
        assert alive(torchrun), "the run's processes outlive their agent until a new one"
        task_call(drill, "fleet.local_nodes_revive")
        wait_for("the new agent to stop the old run", lambda: not alive(torchrun), timeout_s=30)
        stopped = time.monotonic() - killed
        back = _running_again(drill, job_id, attempt=2)
        assert checks.finished(drill, job_id, timeout_s=300)["state"] == "succeeded"
    lost = run_of(drill, job_id, attempt=1)
    assert lost["state"] == "lost", lost
    reasons = _reasons(drill, job_id)
    assert any(r.startswith("requeued:") and "local-1" in r for r in reasons), reasons
    assert any(r.startswith("attempt 2 resumed from step") for r in reasons), reasons
    recovered("agent kill -9, started again", back - killed, "kill → job running again")
    recovered("agent restart: old run stopped", stopped, "kill → predecessor's processes gone")


def test_a_rank_killed_and_the_newest_checkpoint_truncated(drill, recovered):
    """kill -9 of trainer rank 1 (what the OOM killer or a hardware fault does): the job is
    requeued as infrastructure, its event naming rank 1 and the signal; its newest
    checkpoint is then truncated, so the trainer rejects it on resume and falls back to the
    one before, and the job's events say which it resumed from."""
    with only_on(drill, "local-2"):
        job_id = submit(drill, trainer(drill, steps=400))
        run = _training(drill, job_id, checkpoints=2)
        rank1 = next(w for w in workers_of(run["pid"]) if w.rank == 1)
        os.kill(rank1.pid, signal.SIGKILL)
        killed = time.monotonic()
        checks.in_state(drill, job_id, "pending", "admitted", "provisioning", "starting")
        requeued = [r for r in _reasons(drill, job_id) if r.startswith("requeued:")]
        assert requeued and "rank 1" in requeued[0] and "signal 9" in requeued[0], requeued
        newest_step, newest = checkpoints_committed(drill, job_id)[-1]
        wait_for(  # verified, so that the registry offers it and the trainer must refuse it
            "the newest checkpoint to be verified",
            lambda: drill.sql(
                "SELECT 1 FROM checkpoints_checkpoint WHERE job_id = %s AND step = %s "
                "AND state = 'verified'",
                job_id,
                newest_step,
            ),
            timeout_s=60,
        )
        biggest = max(Path(newest).rglob("*.distcp"), key=lambda p: p.stat().st_size)
        with open(biggest, "r+b") as shard:
            shard.truncate(biggest.stat().st_size // 2)
        back = _running_again(drill, job_id, attempt=2)
        assert checks.finished(drill, job_id, timeout_s=300)["state"] == "succeeded"
    reasons = _reasons(drill, job_id)
    told = "\n".join(reasons)
    resumed = [int(r.split()[5]) for r in reasons if r.startswith("attempt 2 resumed from step")]
    assert resumed and resumed[0] < newest_step, told
    # The truncated checkpoint was refused one way or the other: not offered (the registry
    # had not verified it, or found it corrupt), or offered and rejected by the trainer.
    if any(r.endswith(f"checkpoint offered: {newest}") for r in reasons):
        assert any("rejected" in r and Path(newest).name in r for r in reasons), told
    recovered("trainer rank kill -9", back - killed, "kill → job running again")


def test_a_draining_node_whose_agent_dies(drill, recovered):
    """A busy node is drained, then dies (its agent and its job's processes killed): it goes
    SUSPECT then DOWN, its job is requeued; when its agent is started again it is checked
    and stays DRAINED, as ops left it."""
    with only_on(drill, "local-3") as (node_id,):
        job_id = submit(drill, command(drill, ["sleep", "300"], gpus=2, name="draining"))
        checks.in_state(drill, job_id, "running")
        run = run_of(drill, job_id)
        answer = drill.api("POST", f"/api/v1/nodes/{node_id}/drain/", {"reason": "drill"})
        assert answer.json()["state"] == "draining", answer.text
        os.kill(agent_pid(drill, node_id), signal.SIGKILL)
        os.killpg(run["pid"], signal.SIGKILL)
        died = time.monotonic()
        wait_for("the node to go DOWN", lambda: checks.node_state(drill, node_id) == "down")
        down = time.monotonic() - died
        checks.in_state(drill, job_id, "pending")
        requeued = time.monotonic() - died
        drill.api("POST", f"/api/v1/jobs/{job_id}/cancel/", {"reason": "drill over"})
        task_call(drill, "fleet.local_nodes_revive")
        wait_for("the node to come back", lambda: checks.node_state(drill, node_id) == "drained")
    assert checks.finished(drill, job_id)["state"] == "cancelled"
    assert run_of(drill, job_id)["state"] == "lost"
    recovered("draining node dies", down, "death → node DOWN")
    recovered("draining node dies: job", requeued, "death → job requeued")


def test_a_node_that_stops_answering_gets_no_new_work(drill, recovered):
    """A node's agent paused (SIGSTOP: it neither heartbeats nor polls): jobs submitted while
    it is quiet go elsewhere, never to it; resumed, it takes work again."""
    with only_on(drill, "local-1", "local-2") as (quiet_id, other_id):
        agent = agent_pid(drill, quiet_id)
        os.kill(agent, signal.SIGSTOP)
        try:
            time.sleep(3.5)  # past NODE_QUIET_AFTER_S
            ids = [
                submit(drill, command(drill, ["sleep", "1"], gpus=2, name=f"quiet-{n}"))
                for n in range(3)
            ]
            for job_id in ids:
                checks.finished(drill, job_id, timeout_s=120)
        finally:
            os.kill(agent, signal.SIGCONT)
        resumed = time.monotonic()
        wait_for("the node to answer again", lambda: checks.node_state(drill, quiet_id) == "ready")
        back = time.monotonic() - resumed
    placed = {run_of(drill, job_id)["node"] for job_id in ids}
    assert placed == {other_id}, placed
    recovered("agent paused, resumed", back, "SIGCONT → node READY")


def test_an_ssh_node_lost_in_a_two_node_job(drill, recovered):
    """A two-node trainer job on the SSH nodes; one node dies (its agent and processes
    killed). The job is requeued, its events naming the node that was really lost, and it
    finishes on the node left (min_nodes 1), resuming from its checkpoint."""
    with only_on(drill, "ssh-1", "ssh-2"):
        job_id = submit(drill, trainer(drill, nodes=2, steps=300, min_nodes=1))
        _training(drill, job_id)
        victim = run_of(drill, job_id, attempt=1, node_rank=1)
        victim_name = drill.sql("SELECT name FROM fleet_node WHERE id = %s", victim["node"])[0][0]
        os.kill(agent_pid(drill, victim["node"]), signal.SIGKILL)
        os.killpg(victim["pid"], signal.SIGKILL)
        died = time.monotonic()
        back = _running_again(drill, job_id, attempt=2)
        assert checks.finished(drill, job_id, timeout_s=300)["state"] == "succeeded"
    reasons = _reasons(drill, job_id)
    assert any(victim_name in r and "lost" in r for r in reasons), reasons
    # Resumed from its checkpoint, by attempt 2 or, where attempt 2 was placed on the dying
    # node before it was seen quiet, by the next.
    assert any(" resumed from step " in r for r in reasons), "\n".join(reasons)
    recovered("SSH node lost mid-job", back - died, "death → job running on the node left")


def test_a_disk_that_fills_during_a_checkpoint(drill):
    """The `tight` team's checkpoints live on a small tmpfs with room for one checkpoint: the
    trainer checks the free space before its next save, says what it needs, removes its own
    temporary files, and the job is retried as a storage fault, then FAILED at its restart
    limit; the checkpoint already committed is kept."""
    tight = Path(drill.checkpoints) / "tight"
    tight.mkdir(mode=0o711, exist_ok=True)
    size = f"size={TIGHT_KIB}k,mode=0711"
    subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(tight)], check=True)
    try:
        with only_on(drill, "local-1"):
            job_id = submit(drill, trainer(drill, team="tight", steps=400, restart_limit=1))
            ended = checks.finished(drill, job_id, timeout_s=300)
        assert ended["state"] == "failed", ended
        assert ended["restarts"] == 1
        assert "checkpoint: needs" in ended["reason"] and "free" in ended["reason"], ended
        assert not list(tight.rglob(".tmp-step-*")), "temporary checkpoint files left"
        assert checkpoints_committed(drill, job_id), "the committed checkpoint was lost"
    finally:
        subprocess.run(["umount", "-l", str(tight)], check=False)
