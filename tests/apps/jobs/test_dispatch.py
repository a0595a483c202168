"""Dispatch of a job with a node range: an attempt runs on the nodes it was given, with
torchrun, its environment and run.json's layout for that count, and says so in its events."""

import datetime as dt
import json

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.fleet.models import Node, NodeState
from apps.fleet.services import node_drain, node_transition, nodes_heartbeat_sweep
from apps.jobs import services, transitions
from apps.jobs.dispatch import job_dispatch, jobs_on_down_nodes, jobs_on_lost_nodes, run_report
from apps.jobs.models import Allocation, Job, JobState, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import command_spec, trainer_spec

pytestmark = pytest.mark.django_db

CHECKPOINT = "/shared/checkpoints/team/job-1/step-00000010"


def run_json(run: Run) -> dict:
    (item,) = [f for f in run.plan["files"] if f["path"] == "run.json"]
    return json.loads(item["content"])


def only_two_nodes(pool, ops_user) -> list[Node]:
    """Drain all but two of the pool's nodes; return those two."""
    nodes = list(Node.objects.filter(pool=pool).order_by("name"))
    for node in nodes[2:]:
        node_drain(node=node, reason="elsewhere", by=ops_user)
    return nodes[:2]


def submit_ranged(team, user, *, nodes: int, min_nodes: int) -> Job:
    spec = trainer_spec(
        team,
        preset="tiny",
        nodes=nodes,
        gpus_per_node=8,
        layout={"dp_shard": nodes * 8},
        seq_len=256,
        global_batch=48,  # splits over the 8, 16 and 24 data-parallel ranks of 1 to 3 nodes
    )
    spec["resources"]["min_nodes"] = min_nodes
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=user)
    return job


def test_a_job_that_lost_a_node_resumes_on_the_one_left_with_its_global_batch(
    fleet_pool, quota, team, researcher, ops_user, api_for, client
):
    kept, lost = only_two_nodes(fleet_pool, ops_user)
    job = submit_ranged(team, researcher, nodes=2, min_nodes=1)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    first = list(Run.objects.filter(job=job, attempt=1).order_by("node_rank"))
    assert [run.node_id for run in first] == [kept.pk, lost.pk]
    assert "--nnodes=2" in first[0].plan["argv"]
    assert run_json(first[0])["layout"]["dp_shard"] == 16
    for run in first:
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})

    node_transition(node=lost, to=NodeState.SUSPECT, reason="no heartbeat", by=None)
    node_transition(node=lost, to=NodeState.DOWN, reason="no heartbeat", by=None)
    assert jobs_on_down_nodes() == [job.pk]
    # The kept node's agent stops its rank; its GPUs come free once the process is gone.
    survivor = first[0]
    report = {"state": "exited", "signal": 15, "reason": "stopped"}
    run_report(node_id=survivor.node_id, run_id=survivor.pk, report=report)
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED, job.pending_reason
    job = job_dispatch(job_id=job.pk, resume_from=CHECKPOINT)

    (second,) = Run.objects.filter(job=job, attempt=2)
    assert (second.node_id, second.node_rank) == (kept.pk, 0)
    assert "--nnodes=1" in second.plan["argv"]
    assert "--nproc-per-node=8" in second.plan["argv"]
    assert second.plan["env"]["CONTROLPLANE_NNODES"] == "1"
    config = run_json(second)
    # The data-parallel degree takes up the change; the global batch stays.
    assert config["layout"] == {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1}
    assert config["schedule"]["global_batch"] == 48
    assert config["checkpoint"]["resume_from"] == CHECKPOINT
    assert job.state == JobState.STARTING
    assert job.events.last().reason == (
        f"attempt 2: plans for 1 node(s) offered (1 of 2 nodes); checkpoint offered: {CHECKPOINT}"
    )

    detail = api_for(researcher).get(f"/api/v1/jobs/{job.pk}/").json()
    assert (detail["nodes"], detail["min_nodes"], detail["attempt_nodes"]) == (2, 1, 1)
    client.force_login(researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "or as few as 1 when no more fit; attempt 2 on 1 node<" in page


def test_the_job_of_a_draining_node_whose_agent_died_is_requeued(
    fleet_pool, quota, team, researcher, ops_user, settings
):
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})
    node = node_drain(node=Node.objects.get(pk=run.node_id), reason="fans", by=ops_user)
    assert node.state == NodeState.DRAINING
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now)
    nodes_heartbeat_sweep(now=now + dt.timedelta(seconds=settings.NODE_SUSPECT_AFTER_S + 1))
    nodes_heartbeat_sweep(now=now + dt.timedelta(seconds=settings.NODE_DOWN_AFTER_S + 1))
    assert Node.objects.get(pk=node.pk).state == NodeState.DOWN
    assert jobs_on_down_nodes() == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING


def test_an_attempt_below_min_nodes_is_requeued(fleet_pool, quota, team, researcher, ops_user):
    job = submit_ranged(team, researcher, nodes=3, min_nodes=2)
    only_two_nodes(fleet_pool, ops_user)
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED and job.allocations.count() == 2
    # One of its nodes is taken back before its plans are written.
    allocation = job.allocations.first()
    Allocation.objects.filter(pk=allocation.pk).update(ended_at=allocation.started_at)

    job = job_dispatch(job_id=job.pk)

    assert job.state == JobState.PENDING
    assert job.state_reason == "requeued: 1 of 3 nodes still allocated; it needs at least 2"
    assert not Run.objects.filter(job=job).exists()


def test_a_job_without_a_range_runs_on_all_its_nodes_as_before(fleet_pool, quota, team, researcher):
    spec = trainer_spec(
        team, preset="tiny", nodes=2, layout={"dp_shard": 16}, seq_len=256, global_batch=64
    )
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    runs = list(Run.objects.filter(job=job))
    assert len(runs) == 2
    assert all("--nnodes=2" in run.plan["argv"] for run in runs)
    assert {run.plan["env"]["CONTROLPLANE_NNODES"] for run in runs} == {"2"}
    assert run_json(runs[0])["layout"]["dp_shard"] == 16
    assert job.events.last().reason == "attempt 1: plans for 2 node(s) offered"


# --- what the job's timeline says of failures ---------------------------------------------------


def _two_ranks_running(team, researcher) -> tuple[Job, list[Run]]:
    spec = trainer_spec(
        team, preset="tiny", nodes=2, layout={"dp_shard": 16}, seq_len=256, global_batch=64
    )
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    runs = list(Run.objects.filter(job=job).order_by("node_rank"))
    for run in runs:
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})
    return Job.objects.get(pk=job.pk), runs


def _collective_timeout(run: Run) -> Run:
    report = {"state": "exited", "exit_code": 1, "status": {"reason": "collective_timeout"}}
    return run_report(node_id=run.node_id, run_id=run.pk, report=report)


def test_a_note_records_something_about_a_job_without_moving_it(
    fleet_pool, quota, team, researcher
):
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    before = (job.state, job.state_changed_at, job.events.count())
    note = transitions.job_note(job_id=job.pk, reason="attempt 1 resumed from step 10 (/x)")
    job.refresh_from_db()
    assert (note.from_state, note.to_state) == (job.state, job.state) == ("pending", "pending")
    assert note.reason == "attempt 1 resumed from step 10 (/x)" and note.actor is None
    assert (job.state, job.state_changed_at) == before[:2]
    assert job.events.count() == before[2] + 1
    assert transitions.job_note(job_id=10**9, reason="gone") is None


def test_a_collective_timeout_is_told_as_a_symptom_and_the_lost_peer_is_named_later(
    fleet_pool, quota, team, researcher
):
    """A node's agent dies: the healthy rank times out first and the job is requeued on
    it; its peer, found lost afterwards, is the cause, and the timeline says so."""
    job, (healthy, dead) = _two_ranks_running(team, researcher)
    _collective_timeout(healthy)
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.restarts == 1
    assert job.state_reason == (
        f"requeued: rank 0 on {healthy.node.name} lost its peers (collective timeout) "
        "(infrastructure)"
    )
    assert jobs_on_lost_nodes(node_ids=[dead.node_id]) == []  # already requeued
    note = job.events.last()
    assert note.from_state == note.to_state == JobState.PENDING
    assert note.reason == f"attempt 1: rank 1 on {dead.node.name} was lost: node lost"
    assert Job.objects.get(pk=job.pk).restarts == 1


def test_a_lost_run_is_named_before_a_collective_timeout(fleet_pool, quota, team, researcher):
    job, (healthy, dead) = _two_ranks_running(team, researcher)
    # Found lost by a sweep that has not moved its job yet (as runs_stop_for marks runs).
    Run.objects.filter(pk=dead.pk).update(state="lost", reason="the node's agent no longer runs it")
    _collective_timeout(healthy)
    job.refresh_from_db()
    assert job.state_reason == (
        f"requeued: rank 1 on {dead.node.name} was lost: the node's agent no longer runs it "
        "(infrastructure)"
    )


@pytest.mark.parametrize(
    "report,told",
    [
        # Killed by something else (the kernel's OOM killer): the likely cause.
        ({"state": "exited", "signal": 9}, True),
        # Stopped by its agent, as the requeue asked: nothing to tell.
        ({"state": "exited", "signal": 15, "reason": "requeued: rank 0 ..."}, False),
    ],
)
def test_a_peer_ended_by_a_signal_after_the_requeue_is_named_unless_it_was_stopped(
    fleet_pool, quota, team, researcher, report, told
):
    job, (healthy, peer) = _two_ranks_running(team, researcher)
    _collective_timeout(healthy)
    events = job.events.count()
    run_report(node_id=peer.node_id, run_id=peer.pk, report=report)
    assert job.events.count() == events + told
    if told:
        note = job.events.last()
        assert note.reason == f"attempt 1: rank 1 on {peer.node.name} ended with signal 9"
        assert note.from_state == note.to_state == JobState.PENDING


def test_a_rank_whose_death_the_evidence_shows_is_named_though_its_peers_timed_out(
    fleet_pool, quota, team, researcher
):
    """Rank 1 of node 0 was killed; torchrun's other rank saw the collective time out and
    the status file says so: the evidence names the death, not the symptom."""
    job, (first, _) = _two_ranks_running(team, researcher)
    killed = {"kind": "signal", "signal": 9, "pid": 4321, "rank": 1, "local_rank": 1}
    report = {
        "state": "exited",
        "exit_code": 1,
        "status": {"reason": "collective_timeout"},
        "evidence": {**killed, "command": "python"},
    }
    run_report(node_id=first.node_id, run_id=first.pk, report=report)
    job.refresh_from_db()
    assert job.state_reason == (
        f"requeued: rank 1 (pid 4321) on {first.node.name} was killed by signal 9 (SIGKILL) "
        "(infrastructure)"
    )


# --- a gang whose ranks do not overlap --------------------------------------------------------


@pytest.mark.parametrize("first_ends_before_second_starts", [True, False])
def test_a_short_job_whose_ranks_never_all_ran_at_once_still_succeeds(
    fleet_pool, quota, team, researcher, first_ends_before_second_starts
):
    """A quick command on two nodes: one node's run may start, finish and report its exit
    before the other node's agent has even reported its start, so the job never sees all
    its ranks running at once. It did run, and it ended well: RUNNING, then SUCCEEDED."""
    spec = command_spec(team, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    quick, slow = Run.objects.filter(job=job).order_by("node_rank")

    def report(run, state, **more):
        return run_report(node_id=run.node_id, run_id=run.pk, report={"state": state, **more})

    report(quick, "running", pid=7)
    report(quick, "exited", exit_code=0)
    if first_ends_before_second_starts:
        report(slow, "running", pid=8)
        report(slow, "exited", exit_code=0)
    else:  # its start report lost: its exit is all the control plane hears of it
        report(slow, "exited", exit_code=0)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, (job.state, job.state_reason)
    moves = list(job.events.order_by("pk").values_list("to_state", flat=True))
    assert moves[-2:] == [JobState.RUNNING, JobState.SUCCEEDED]
    assert job.started_at is not None and job.started_at <= job.finished_at
    assert all(a.ended_at is not None for a in Allocation.objects.filter(job=job))


@st.composite
def report_orders(draw):
    """Each rank's reports (its start, which may be lost, then its exit 0), interleaved."""
    ranks = draw(st.integers(min_value=2, max_value=3))
    per_rank = [(["running"] if draw(st.booleans()) else []) + ["exited"] for _ in range(ranks)]
    order = []
    while any(per_rank):
        rank = draw(st.sampled_from([r for r, left in enumerate(per_rank) if left]))
        order.append((rank, per_rank[rank].pop(0)))
    return ranks, order


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=report_orders())
def test_ranks_that_end_well_in_any_order_end_the_job_well(
    fleet_pool, quota, team, researcher, case
):
    ranks, order = case
    resources = {"gpu_type": "H100", "nodes": ranks, "gpus_per_node": 8}
    job, _ = services.job_submit(
        team=team, spec=command_spec(team, resources=resources), submitted_by=researcher
    )
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    runs = list(Run.objects.filter(job=job).order_by("node_rank"))
    for rank, state in order:
        run = runs[rank]
        report = (
            {"state": state, "pid": 7} if state == "running" else {"state": state, "exit_code": 0}
        )
        run_report(node_id=run.node_id, run_id=run.pk, report=report)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, (order, job.state, job.state_reason)
    assert job.started_at is not None
    assert not Allocation.objects.filter(job=job, ended_at__isnull=True).exists()
