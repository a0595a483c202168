"""What an agent saw of how a run's processes died (its exit watch, not the job's output):
kept only when well formed, and a rank the node's kernel killed requeues the job as
infrastructure, with the rank, pid, node and how in its event."""

import pytest

from apps.fleet.models import Node
from apps.jobs.dispatch import run_report
from apps.jobs.models import Job, JobEvent, JobState, Run
from tests.apps.jobs.test_one_road import started, submit

pytestmark = pytest.mark.django_db

KILLED = {
    "kind": "signal",
    "signal": 9,
    "pid": 4321,
    "rank": 1,
    "local_rank": 1,
    "command": "python",
}


def _one_rank_exits(job: Job, **report) -> Run:
    (run,) = started(job)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "exited", **report})
    run.refresh_from_db()
    return run


def _node_name(run: Run) -> str:
    return Node.objects.get(pk=run.node_id).name


def test_a_rank_killed_by_sigkill_requeues_the_job_naming_rank_pid_node_and_signal(
    fleet_pool, quota, team, researcher
):
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    run = _one_rank_exits(job, exit_code=1, evidence=KILLED)
    assert run.evidence == {**KILLED, "incomplete": False}
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert job.restarts == 1
    event = JobEvent.objects.filter(job=job).latest("at")
    assert event.to_state == JobState.PENDING
    assert event.reason == (
        f"requeued: rank 1 (pid 4321) on {_node_name(run)} was killed by signal 9 (SIGKILL) "
        "(infrastructure)"
    )


def test_a_signal_to_a_process_that_is_not_a_rank_is_the_jobs_own_doing(
    fleet_pool, quota, team, researcher
):
    """A command job that SIGKILLs a subprocess of its own and then exits 1 failed on its
    own: only the kernel's OOM kills and ranks' deaths are evidence of the node."""
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    helper = {**KILLED, "rank": None, "local_rank": None, "command": "curl"}
    _one_rank_exits(job, exit_code=1, evidence=helper)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.restarts == 0
    assert job.state_reason.endswith("ended with exit code 1")


def test_an_oom_kill_is_named_as_the_kernels_and_without_a_rank_the_node_rank_stands_in(
    fleet_pool, quota, team, researcher, client
):
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    oom = {**KILLED, "kind": "oom", "rank": None, "local_rank": None}
    run = _one_rank_exits(job, exit_code=137, evidence=oom)
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert job.state_reason == (
        f"requeued: rank 0 (pid 4321) on {_node_name(run)} was killed by the kernel's OOM "
        "killer (infrastructure)"
    )
    client.force_login(researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert '<div class="muted">OOM-killed: pid 4321</div>' in page


def test_past_the_restart_limit_a_killed_rank_fails_the_job_saying_so(
    fleet_pool, quota, team, researcher
):
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    Job.objects.filter(pk=job.pk).update(restart_limit=0)
    _one_rank_exits(job, exit_code=1, evidence=KILLED)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.state_reason.endswith(
        "was killed by signal 9 (SIGKILL) (infrastructure); restart limit (0) reached"
    )


@pytest.mark.parametrize(
    "evidence",
    [
        None,
        "oom",
        {**KILLED, "kind": "hardware"},
        {**KILLED, "signal": 0},
        {**KILLED, "signal": 65},
        {**KILLED, "signal": True},
        {**KILLED, "pid": -1},
        {**KILLED, "pid": "4321"},
        {**KILLED, "rank": -1},
        {**KILLED, "rank": "1"},
        {**KILLED, "command": "x" * 65},
        {**KILLED, "command": "<script>"},
        {key: value for key, value in KILLED.items() if key != "pid"},
    ],
)
def test_evidence_not_as_the_agent_writes_it_is_dropped_and_the_exit_code_decides(
    fleet_pool, quota, team, researcher, evidence
):
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    run = _one_rank_exits(job, exit_code=1, evidence=evidence)
    assert run.evidence is None
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.state_reason == f"rank 0 on {_node_name(run)} ended with exit code 1"


def test_evidence_from_incomplete_events_is_kept_and_says_so(fleet_pool, quota, team, researcher):
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    run = _one_rank_exits(job, exit_code=1, evidence={**KILLED, "incomplete": True})
    assert run.evidence["incomplete"] is True
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert "some process events were lost" in job.state_reason
