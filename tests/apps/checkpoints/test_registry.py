"""The registry fed as the agent feeds it: the trainer's checkpoint lines relayed by the agent's
real code, directories checked by the agent's real code against real files."""

import json

import pytest

from apps.checkpoints import services
from apps.checkpoints.models import Checkpoint, CheckpointCopy, CheckpointEvent, StorageSweep
from apps.jobs.models import Job, Run
from apps.jobs.runconfig import checkpoint_dir
from tests.apps.checkpoints.conftest import agent_of, commit_event, report, write_checkpoint

pytestmark = pytest.mark.django_db


def _dir(job):
    from pathlib import Path

    return Path(checkpoint_dir(job))


def test_a_committed_checkpoint_is_registered_then_verified_by_the_agent_that_wrote_it(
    running_job,
):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(_dir(running_job), 10, job=running_job)

    report(keeper, run, commit_event(path, digest, 10))
    report(keeper, run, commit_event(path, digest, 10))  # the outbox's retry: kept once

    checkpoint = Checkpoint.objects.get(job=running_job)
    assert (checkpoint.step, checkpoint.state, checkpoint.attempt) == (10, "committed", 1)
    assert checkpoint.world_size == 8 and checkpoint.layout["dp_shard"] == 8
    (copy,) = checkpoint.copies.all()
    assert (copy.kind, copy.location, copy.request) == ("shared", str(path.resolve()), "verify")
    assert copy.request_node_id == run.node_id

    assert keeper.poll_once() == 1  # the agent checks every file against the manifest
    checkpoint.refresh_from_db()
    assert checkpoint.state == "verified" and checkpoint.verified_at is not None
    assert CheckpointCopy.objects.get(pk=copy.pk).state == "verified"
    assert keeper.poll_once() == 0  # nothing more to do
    moves = list(CheckpointEvent.objects.filter(checkpoint=checkpoint).values_list("to_state"))
    assert moves == [("committed",), ("verified",), ("verified",)]


def test_lines_that_are_not_checkpoint_events_are_not_reported(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    keeper.relay(run.pk, json.dumps({"event": "step", "step": 3, "loss": 4.0}))
    keeper.relay(run.pk, '{"event":"checkpoint","step"')  # cut short
    keeper.relay(run.pk, "checkpoint written")
    assert not Checkpoint.objects.exists()


def test_another_nodes_run_is_refused(running_job, fleet_pool):
    from apps.fleet.models import Node

    run = Run.objects.get(job=running_job)
    other = Node.objects.filter(pool=fleet_pool).exclude(pk=run.node_id).first()
    keeper = agent_of(other)
    path, digest = write_checkpoint(_dir(running_job), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    assert keeper.outbox.refused == [(f"run {run.pk} checkpoint 10", 404)]
    assert not Checkpoint.objects.exists()


def test_a_truncated_file_is_caught_and_resume_falls_back_to_the_newest_verified(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    for step in (10, 20):
        path, digest = write_checkpoint(_dir(running_job), step, job=running_job)
        report(keeper, run, commit_event(path, digest, step))
    keeper.poll_once()
    assert set(Checkpoint.objects.values_list("state", flat=True)) == {"verified"}

    shard = path / "__0_0.distcp"  # step 20's
    shard.write_bytes(shard.read_bytes()[:100])
    newest = Checkpoint.objects.get(step=20)
    services.checkpoint_verify_request(checkpoint=newest, by=None)
    keeper.poll_once()

    newest.refresh_from_db()
    assert newest.state == "corrupt"
    copy = newest.copies.get()
    assert copy.state == "corrupt" and "__0_0.distcp has 100 bytes" in copy.error
    # The job is requeued and placed again: resume names step 10, never the corrupt one.
    _requeue_and_place(running_job)
    assert services.checkpoint_resume_prepare(job_id=running_job.pk).wait
    agent_of(_placed_node(running_job)).poll_once()  # the new node lists the directory first
    plan = services.checkpoint_resume_prepare(job_id=running_job.pk)
    assert not plan.wait, plan.reason
    assert plan.step == 10 and plan.resume_from.endswith("step-00000010")


def test_a_long_problem_is_cut_to_the_checkpoints_reason_column(running_job):
    """An agent may report 500 characters (an S3 error names a URI of up to 1,024): the
    checkpoint's reason column holds 300, so PostgreSQL would refuse the whole record."""
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(_dir(running_job), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    keeper.poll_once()
    checkpoint = services.checkpoint_verify_request(
        checkpoint=Checkpoint.objects.get(step=10), by=None
    )
    copy = checkpoint.copies.get()

    services.copy_verification_record(
        copy_id=copy.pk,
        ok=False,
        problem="__0_0.distcp does not match: " + "x" * 460,
        node_id=copy.request_node_id,
    )

    checkpoint.refresh_from_db()
    assert checkpoint.state == "corrupt"
    assert len(checkpoint.state_reason) == 300
    assert "copy corrupt: __0_0.distcp does not match" in checkpoint.state_reason


def _requeue_and_place(job):
    from apps.jobs.dispatch import jobs_on_lost_nodes
    from apps.jobs.scheduler.run import scheduling_pass

    run = Run.objects.filter(job=job).order_by("-attempt").first()
    jobs_on_lost_nodes(node_ids=[run.node_id])
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == "admitted", job.state_reason


def test_nothing_uncommitted_is_offered_and_the_sweep_tidies_and_registers(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    directory = _dir(running_job)
    path, digest = write_checkpoint(directory, 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    keeper.poll_once()
    # A commit whose report never arrived (the agent died), and a write never finished.
    lost, lost_digest = write_checkpoint(directory, 20, job=running_job)
    write_checkpoint(directory, 30, job=running_job, name=".tmp-step-00000030")
    (directory / ".tmp-step-00000030" / "manifest.json").unlink()

    _requeue_and_place(running_job)
    plan = services.checkpoint_resume_prepare(job_id=running_job.pk)
    assert plan.wait and "listed" in plan.reason
    placed = agent_of(_placed_node(running_job))
    placed.poll_once()  # lists: tidies the temporary, registers step 20, asks to check it
    sweep = StorageSweep.objects.get(job=running_job)
    assert sweep.result["adopted"] == 1 and sweep.result["removed"] == [".tmp-step-00000030"]
    assert not (directory / ".tmp-step-00000030").exists()
    adopted = Checkpoint.objects.get(step=20)
    assert adopted.manifest_sha256 == lost_digest and adopted.state == "committed"
    assert services.checkpoint_resume_prepare(job_id=running_job.pk).wait  # step 20 unchecked
    placed.poll_once()
    plan = services.checkpoint_resume_prepare(job_id=running_job.pk)
    assert (plan.wait, plan.step, plan.resume_from) == (False, 20, str(lost.resolve()))
    assert Checkpoint.objects.get(step=20).offered_at is not None


def _placed_node(job):
    from apps.fleet.models import Node

    return Node.objects.filter(allocations__job=job, allocations__ended_at__isnull=True).first()


def test_resume_waits_no_longer_than_the_limit(running_job, settings):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(_dir(running_job), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    _requeue_and_place(running_job)
    settings.CHECKPOINT_RESUME_WAIT_S = 0  # the new node never answers in time
    plan = services.checkpoint_resume_prepare(job_id=running_job.pk)
    assert not plan.wait
    assert plan.resume_from is None and "from the start" in plan.reason


def test_a_step_saved_again_moves_the_old_copy_aside_and_keeps_both_registered(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    directory = _dir(running_job)
    first, first_digest = write_checkpoint(directory, 10, job=running_job)
    report(keeper, run, commit_event(first, first_digest, 10))
    # The trainer saved step 10 again: the old directory was renamed aside first.
    aside = directory / ".replaced-step-00000010-1"
    first.rename(aside)
    second, second_digest = write_checkpoint(directory, 10, job=running_job, attempt=2)
    report(keeper, run, commit_event(second, second_digest, 10, replaced=str(aside.resolve())))
    old, new = Checkpoint.objects.order_by("id")
    assert old.copies.get().location == str(aside.resolve())
    assert new.copies.get().location == str(second.resolve())
    keeper.poll_once()
    assert {c.state for c in Checkpoint.objects.all()} == {"verified"}


def test_the_trainer_refusing_a_copy_on_resume_marks_it_corrupt(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(_dir(running_job), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    keeper.poll_once()
    report(
        keeper,
        run,
        {"event": "checkpoint_rejected", "path": str(path.resolve()), "reason": "x is missing"},
    )
    checkpoint = Checkpoint.objects.get()
    assert checkpoint.state == "corrupt" and "x is missing" in checkpoint.state_reason
    note = running_job.events.last()  # the job's timeline says so, without a state change
    assert note.from_state == note.to_state == "running"
    assert note.reason == f"attempt 1 rejected the checkpoint at {path.resolve()}: x is missing"


def test_the_jobs_timeline_says_which_checkpoint_an_attempt_resumed_from(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(_dir(running_job), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    states = list(running_job.events.values_list("to_state", flat=True))
    report(keeper, run, {"event": "resume", "step": 10, "path": str(path.resolve())})
    note = running_job.events.last()
    assert note.from_state == note.to_state == "running"
    assert note.reason == f"attempt 1 resumed from step 10 ({path.resolve()})"
    assert list(running_job.events.values_list("to_state", flat=True)) == [*states, "running"]
    assert Job.objects.get(pk=running_job.pk).state == "running"


def test_a_bad_event_is_a_400_that_names_the_field(running_job):
    from django.test import Client

    from apps.fleet.agents import node_agent_token_issue

    run = Run.objects.get(job=running_job)
    token = node_agent_token_issue(node=run.node)
    answer = Client().post(
        "/api/v1/agent/checkpoints/events",
        data=json.dumps({"run": run.pk, "event": {"event": "checkpoint", "step": 1, "path": "/x"}}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert answer.status_code == 400
    assert "event.manifest_sha256" in answer.json()["error"]["details"]
    assert Client().get("/api/v1/agent/checkpoints/work").status_code == 401
