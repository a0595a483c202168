"""Every job state change takes one road (services.jobs_move), the scheduler's too: a running
job chosen for preemption is asked to stop at once, and no GPU is handed to another job
while a process of the job that held it is still there."""

import pytest

from apps.accounts import services as accounts
from apps.accounts.models import AuditEvent
from apps.jobs import services
from apps.jobs.dispatch import agent_work, job_dispatch, run_report
from apps.jobs.models import Allocation, Job, JobEvent, JobState, Run
from apps.jobs.models.jobs import lowest_free, mask_of, slots_of
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


def submit(team, user, **overrides) -> Job:
    job, _ = services.job_submit(team=team, spec=command_spec(team, **overrides), submitted_by=user)
    return job


def started(job: Job) -> list[Run]:
    """Place, dispatch and have every node's agent report its run started."""
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    runs = list(Run.objects.filter(job=job).order_by("node_rank"))
    for run in runs:
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 100})
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    return runs


def exited(run: Run, code: int = 0) -> None:
    run_report(
        node_id=run.node_id,
        run_id=run.pk,
        report={"state": "exited", "exit_code": code, "reason": run.stop_reason},
    )


def open_gpus(job: Job) -> int:
    return sum(
        Allocation.objects.filter(job=job, ended_at__isnull=True).values_list("gpus", flat=True)
    )


def test_a_running_victim_is_asked_to_stop_at_once_and_frees_its_gpus_only_when_gone(
    fleet_pool, team, researcher
):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    low = submit(
        team,
        researcher,
        name="low",
        priority="low",
        resources={"gpu_type": "H100", "nodes": 4, "gpus_per_node": 8},
    )
    runs = started(low)
    urgent = submit(
        team,
        researcher,
        name="urgent",
        priority="urgent",
        resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8},
    )
    scheduling_pass()

    low.refresh_from_db()
    assert low.state == JobState.PREEMPTING
    assert "preempted by a higher-priority job" in low.state_reason
    # Asked at once: every node's agent sees the stop on its next poll.
    for run in runs:
        assert agent_work(node_id=run.node_id)["stop"] == [
            {"id": run.pk, "reason": low.state_reason}
        ]
    event = JobEvent.objects.get(job=low, to_state=JobState.PREEMPTING)
    assert event.actor_label == "scheduler"
    assert AuditEvent.objects.filter(action="job.preempting", object_id=str(low.pk)).exists()
    assert open_gpus(low) == 32  # still held: its processes are still there

    scheduling_pass()  # the preemptor cannot start on GPUs still in use
    urgent.refresh_from_db()
    assert urgent.state == JobState.PENDING

    for run in runs[:3]:
        exited(run, code=0)
    low.refresh_from_db()
    assert low.state == JobState.PREEMPTING and open_gpus(low) == 32
    exited(runs[3], code=0)
    low.refresh_from_db()
    assert low.state == JobState.PENDING
    assert low.state_reason == "preempted: stopped; back in the queue to resume"
    assert open_gpus(low) == 0

    scheduling_pass()
    urgent.refresh_from_db()
    assert urgent.state == JobState.ADMITTED


def test_a_requeue_keeps_the_gpus_of_a_rank_still_running_until_it_ends(
    fleet_pool, quota, team, researcher
):
    job = submit(team, researcher, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    first, second = started(job)
    # Rank 0's node reports an infrastructure stop: the job goes back to the queue, but
    # rank 1 is still running on its node.
    run_report(
        node_id=first.node_id,
        run_id=first.pk,
        report={"state": "exited", "exit_code": 1, "status": {"reason": "node_lost"}},
    )
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    second.refresh_from_db()
    assert second.stop_requested_at is not None
    held = Allocation.objects.get(job=job, node_id=second.node_id, ended_at__isnull=True)
    assert held.release_wanted
    assert not Allocation.objects.filter(
        job=job, node_id=first.node_id, ended_at__isnull=True
    ).exists()

    exited(second, code=-15)
    held.refresh_from_db()
    assert held.ended_at is not None


@pytest.mark.parametrize(
    ("status", "state", "restarts"),
    [
        # A checkpoint the disk could not take: the storage's failure, retried.
        (
            {"reason": "storage", "message": "checkpoint: needs 13.2 GB at /ckpt, 4.1 GB free"},
            JobState.PENDING,
            1,
        ),
        # The same exit code with the job's own error: FAILED, not retried.
        ({"reason": "code_error", "message": "ValueError: bad"}, JobState.FAILED, 0),
    ],
)
def test_a_run_that_ran_out_of_checkpoint_storage_is_requeued(
    fleet_pool, quota, team, researcher, status, state, restarts
):
    job = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    (run,) = started(job)
    run_report(
        node_id=run.node_id,
        run_id=run.pk,
        report={"state": "exited", "exit_code": 1, "status": status},
    )
    job.refresh_from_db()
    assert job.state == state
    assert job.restarts == restarts
    if state == JobState.PENDING:
        assert job.state_reason.startswith("requeued:")
        assert job.state_reason.endswith("(infrastructure)")
        assert "could not save: checkpoint: needs 13.2 GB at /ckpt, 4.1 GB free" in (
            job.state_reason
        )


def test_jobs_sharing_a_node_get_gpus_of_their_own_and_see_only_those(
    fleet_pool, quota, team, researcher
):
    jobs = [
        submit(team, researcher, name=f"part-{i}", resources={"gpu_type": "H100", "gpus": gpus})
        for i, gpus in enumerate((3, 2, 3))
    ]
    scheduling_pass()
    allocations = list(Allocation.objects.filter(job__in=jobs, ended_at__isnull=True))
    assert len({a.node_id for a in allocations}) == 1  # packed on one node
    masks = [a.gpu_slots for a in allocations]
    assert sum(bin(m).count("1") for m in masks) == 8
    assert masks[0] | masks[1] | masks[2] == 0xFF  # the eight GPUs, each held once
    for job in jobs:
        job_dispatch(job_id=job.pk)
        run = Run.objects.get(job=job)
        held = Allocation.objects.get(job=job)
        assert run.allocation_id == held.pk
        assert run.plan["gpu_slots"] == held.slots
        assert run.plan["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, held.slots))


def test_an_illegal_state_change_is_refused_and_changes_nothing(fleet_pool, team, researcher):
    job = submit(team, researcher)
    with pytest.raises(services.ApplicationError) as caught:
        services.job_transition(job=job, to=JobState.RUNNING, reason="no", by=None)
    assert caught.value.status == 409
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert not JobEvent.objects.filter(job=job, to_state=JobState.RUNNING).exists()


def test_slot_masks():
    assert slots_of(mask_of([0, 3, 5])) == [0, 3, 5]
    assert lowest_free(0b1011, count=2, size=8) == 0b10100
    assert lowest_free(0b1111, count=5, size=8) == 0  # only four free


def test_a_placement_is_stamped_after_the_gpus_it_takes_were_let_go(
    fleet_pool, quota, team, researcher
):
    """A pass read at t0; GPUs let go at t1 > t0 go to a job it places: that allocation
    starts at t1 or later, so the node is never booked past its GPUs at any moment."""
    import datetime as dt

    from django.utils import timezone

    from apps.jobs.scheduler import snapshot as plain
    from apps.jobs.scheduler.apply import Applied, _apply_placements

    read_at = timezone.now() - dt.timedelta(seconds=5)  # the pass's read, before the release
    first = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    scheduling_pass()
    node_id = Allocation.objects.get(job=first).node_id
    services.job_cancel(job=first, by=None)
    freed = Allocation.objects.get(job=first).ended_at
    second = submit(team, researcher, resources={"gpu_type": "H100", "gpus": 8})
    placement = plain.Placement(job_id=second.pk, pool_id=fleet_pool.pk, node_gpus=((node_id, 8),))
    _apply_placements([placement], now=read_at, reasons={}, applied=Applied())
    assert Allocation.objects.get(job=second).started_at >= freed
