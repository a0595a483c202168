"""Multi-node trainer jobs end to end, on local nodes and on SSH nodes: submitted through the
API, placed on two nodes, started by each node's agent as torchrun with the c10d rendezvous
on the head node, trained by every rank (gloo on the CPU), and matching the same job on one
node step for step."""

import json
import math
from dataclasses import dataclass

import pytest

from apps.fleet.models import Node
from apps.jobs.trainer_lines import trainer_event
from tests import factories
from tests.e2e.conftest import (
    Finished,
    log_texts,
    run_directory,
    tiny_trainer_spec,
    trainer_job_run,
    wait_for,
    workers_of,
)
from workers.tasks.provisioning import terminate_node

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

NODES, SLOTS = 2, 2
STEPS = 10
CHECKPOINT_STEPS = [5, 10]  # every 5 steps, and the last
# The layouts compute the same thing: FSDP over the same 4 ranks (dp_shard 4), the same seed,
# the same data for each rank, fp32, one thread per worker (torchrun's default), and gloo
# sums in an order set by the ranks alone, not by which host each one is on. Only the
# transport differs, so the losses should be equal to the last bit: the losses the
# checkpoints record (whole floats) are compared exactly, and the per-step losses the
# trainer prints (to 6 decimals) within 1e-6 relative, which a rounding step at the sixth
# decimal stays inside and any real difference in the computation does not.
LOSS_RTOL = 1e-6


@dataclass
class Losses:
    by_step: dict[int, float]  # as printed each step, 6 decimals
    at_checkpoints: dict[int, float]  # as the checkpoints record them, whole


# The one-node reference, run once for the module and shared by both providers' tests.
_one_node: list[Losses] = []


@pytest.fixture
def one_node_losses(local_nodes, e2e_team, api_for, capsys) -> Losses:
    """The losses of the same job on ONE local node of 4 slots (a world of 4 too)."""
    if not _one_node:
        pool = factories.make_owned_pool(slug="e2e-one-node")
        (node,) = local_nodes(pool, count=1, gpus=NODES * SLOTS)
        api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
        spec = tiny_trainer_spec(e2e_team, nodes=1, gpus_per_node=NODES * SLOTS, steps=STEPS)
        done = trainer_job_run(api, spec)
        assert done.job.state == "succeeded", (done.job.state_reason, log_texts(api, done.job))
        _one_node.append(_losses(api, done))
        # Out of the way: the two-node job that follows must not be placed on this node.
        terminate_node(node.pk)
        _quote(capsys, f"1 local node x {NODES * SLOTS} slots, job {done.job.pk}", done)
    return _one_node[0]


def _losses(api, done: Finished) -> Losses:
    by_step = wait_for(
        "every step's metrics",
        lambda: (losses := done.losses()) and len(losses) == STEPS and losses,
    )
    events = [trainer_event(t) or {} for t in log_texts(api, done.job)]
    checkpoints = [e for e in events if e.get("event") == "checkpoint"]
    assert [c["step"] for c in checkpoints] == CHECKPOINT_STEPS, checkpoints
    assert all(c["world_size"] == NODES * SLOTS for c in checkpoints)
    return Losses(by_step, {c["step"]: c["loss"] for c in checkpoints})


def _quote(capsys, what: str, done: Finished, extra: str = "") -> None:
    """A line for the closing note, shown whatever pytest captures."""
    job = done.job
    running = (job.finished_at - job.started_at).total_seconds()
    with capsys.disabled():
        print(
            f"\n[multinode] {what}: submitted -> succeeded {done.wall_s:.1f} s "
            f"(running {running:.1f} s){extra}"
        )


class WorkerWatch:
    """While the job runs: each node's torchrun and the workers it started, from /proc."""

    def __init__(self):
        self.seen: dict[int, list] = {}  # node id → the workers of its run

    def __call__(self, job) -> None:
        def every_node_has_its_workers():
            job.refresh_from_db()
            assert job.state == "running", f"job {job.pk} is {job.state} before both were seen"
            for run in job.runs.filter(attempt=1).exclude(pid=None):
                workers = workers_of(run.pid)
                if len(workers) == SLOTS:
                    self.seen[run.node_id] = workers
            return len(self.seen) == NODES

        wait_for("both nodes' workers", every_node_has_its_workers, timeout_s=120, every_s=0.1)


def _check_the_two_node_job(api, done: Finished, watch: WorkerWatch, reference, capsys, what):
    job = done.job
    assert job.state == "succeeded", (job.state_reason, log_texts(api, job)[-30:])
    assert (job.dp_replicate, job.dp_shard, job.tp, job.pp) == (1, NODES * SLOTS, 1, 1)

    # One run per node, each started by its node's agent and exited 0 after the last step.
    runs = done.runs
    assert [r.node_rank for r in runs] == [0, 1] and len({r.node_id for r in runs}) == NODES
    for run in runs:
        assert run.state == "exited" and run.exit_code == 0 and run.signal is None, run.reason
        assert run.pid and run.started_at and run.ended_at
        assert run.status["reason"] == "finished" and run.status["step"] == STEPS, run.status

    # torchrun on every node, meeting at the head node's endpoint with one rendezvous id.
    head = Node.objects.get(pk=runs[0].node_id)
    endpoints = set()
    for run in runs:
        argv = run.plan["argv"]
        assert argv[:3] == ["python3", "-m", "torch.distributed.run"]
        assert f"--nnodes={NODES}" in argv and f"--nproc-per-node={SLOTS}" in argv
        assert f"--node-rank={run.node_rank}" in argv and "--rdzv-backend=c10d" in argv
        endpoints |= {a for a in argv if a.startswith(("--rdzv-endpoint=", "--rdzv-id="))}
    assert len(endpoints) == 2, endpoints  # the same endpoint and id on both nodes
    assert f"--rdzv-endpoint={head.address or '127.0.0.1'}:" in " ".join(sorted(endpoints))

    # Both nodes' runs were alive at once, and each node ran two workers of one world of 4.
    overlap = min(r.ended_at for r in runs) - max(r.started_at for r in runs)
    assert overlap.total_seconds() > 0
    for run in runs:
        workers = watch.seen[run.node_id]
        assert [w.local_rank for w in sorted(workers, key=lambda w: w.local_rank)] == [0, 1]
        assert {w.world_size for w in workers} == {NODES * SLOTS}
    ranks = sorted(w.rank for workers in watch.seen.values() for w in workers)
    assert ranks == [0, 1, 2, 3]
    # What each node's trainer left in its run directory there: finished, after the last step.
    for run in runs:
        status = json.loads((run_directory(run) / "status.json").read_text())
        assert status["reason"] == "finished" and status["step"] == STEPS, status
        assert status["rank"] in {w.rank for w in watch.seen[run.node_id]}

    # Every step reported, learning, and equal to the one-node run's; checkpoints written by
    # all four ranks together, at the steps asked for.
    losses = _losses(api, done)
    assert list(losses.by_step) == list(range(1, STEPS + 1))
    assert losses.by_step[STEPS] < losses.by_step[1]
    for step, loss in losses.by_step.items():
        wanted = reference.by_step[step]
        assert math.isclose(loss, wanted, rel_tol=LOSS_RTOL, abs_tol=0), (step, loss, wanted)
    assert losses.at_checkpoints == reference.at_checkpoints
    worst = max(abs(loss - reference.by_step[step]) for step, loss in losses.by_step.items())

    # Nodes are free again once the job ends.
    assert not job.allocations.filter(ended_at__isnull=True).exists()
    _quote(
        capsys,
        f"{what}, job {job.pk}",
        done,
        f"; the nodes' runs overlapped {overlap.total_seconds():.1f} s"
        f"; max |loss - 1-node loss| = {worst:.3g}",
    )


def test_a_two_node_trainer_job_on_local_nodes_matches_one_node(
    local_nodes, e2e_team, api_for, one_node_losses, capsys
):
    pool = factories.make_owned_pool(slug="e2e-two-local")
    local_nodes(pool, count=NODES, gpus=SLOTS)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    watch = WorkerWatch()
    done = trainer_job_run(
        api,
        tiny_trainer_spec(e2e_team, nodes=NODES, gpus_per_node=SLOTS, steps=STEPS),
        while_running=watch,
    )
    _check_the_two_node_job(
        api, done, watch, one_node_losses, capsys, f"{NODES} local nodes x {SLOTS} slots"
    )


def test_a_two_node_trainer_job_on_ssh_nodes_matches_one_node(
    ssh_nodes, e2e_team, api_for, one_node_losses, capsys
):
    pool = factories.make_owned_pool(slug="e2e-two-ssh")
    nodes = ssh_nodes(pool, count=NODES)
    assert {Node.objects.get(pk=n.pk).job_isolation for n in nodes} == {"user"}
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    watch = WorkerWatch()
    done = trainer_job_run(
        api,
        tiny_trainer_spec(e2e_team, nodes=NODES, gpus_per_node=SLOTS, steps=STEPS),
        while_running=watch,
    )
    _check_the_two_node_job(
        api, done, watch, one_node_losses, capsys, f"{NODES} SSH nodes x {SLOTS} slots"
    )
