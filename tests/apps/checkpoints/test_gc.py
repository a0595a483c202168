"""Retention and garbage collection: storage first (the agent for directories, boto3 against a
moto server for S3), rows after; failures retried, "already gone" taken as done; S3 copies
checked before anything older goes, and surviving their node-local copy's deletion."""

import datetime as dt
from pathlib import Path

import boto3
import pytest
from django.utils import timezone

from apps.checkpoints import services
from apps.checkpoints.models import Checkpoint, CheckpointCopy, S3Destination
from apps.fleet.models import Node
from apps.jobs.models import Run
from apps.jobs.runconfig import checkpoint_dir
from tests.apps.checkpoints.conftest import (
    agent_of,
    commit_event,
    report,
    start,
    submit_trainer,
    write_checkpoint,
)
from workers.agent import checkpoints as agent_checkpoints
from workers.providers.s3 import S3Store
from workers.tasks.checkpoints import s3_copies_delete, s3_copies_verify
from workers.trainer.checkpoint import copy_to_s3
from workers.trainer.config import S3Copy

pytestmark = pytest.mark.django_db


def _commit(job, keeper, run, steps):
    for step in steps:
        path, digest = write_checkpoint(Path(checkpoint_dir(job)), step, job=job)
        report(keeper, run, commit_event(path, digest, step))
    keeper.poll_once()


def _on_disk(job) -> set[int]:
    directory = Path(checkpoint_dir(job))
    return {int(p.name[5:]) for p in directory.glob("step-*")}


def _registered(job, *states) -> set[int]:
    rows = Checkpoint.objects.filter(job=job)
    if states:
        rows = rows.filter(state__in=states)
    return set(rows.values_list("step", flat=True))


def _consistent(job) -> None:
    """Every directory on disk has a row whose copy says its files are there, and every such
    copy has its directory."""
    present = {
        Path(c.location).name
        for c in CheckpointCopy.objects.filter(
            checkpoint__job=job,
            kind="shared",
            state__in=["committed", "verified", "corrupt", "deleting"],
        )
    }
    on_disk = {p.name for p in Path(checkpoint_dir(job)).iterdir()}
    assert present == on_disk, (present, on_disk)


def test_retention_keeps_the_newest_every_kth_and_the_final_deleting_storage_first(
    fleet_pool, quota, team, researcher
):
    job = submit_trainer(team, researcher, steps=90, checkpoint_keep=2, checkpoint_keep_every=30)
    run = start(job)
    keeper = agent_of(run.node)
    _commit(job, keeper, run, range(10, 100, 10))  # 10 … 90; 90 is the final step

    assert services.retention_apply()["collected"] == 5  # 10, 20, 40, 50, 70
    assert _registered(job, "deleting") == {10, 20, 40, 50, 70}
    assert _on_disk(job) == set(range(10, 100, 10))  # nothing deleted before storage says so
    _consistent(job)

    keeper.poll_once()  # the agent deletes the directories and says so

    assert _on_disk(job) == {30, 60, 80, 90}
    assert _registered(job, "deleted") == {10, 20, 40, 50, 70}
    assert _registered(job, "verified") == {30, 60, 80, 90}
    _consistent(job)
    assert services.retention_apply()["collected"] == 0


def test_nothing_is_deleted_until_a_newer_checkpoint_is_verified(
    fleet_pool, quota, team, researcher
):
    job = submit_trainer(team, researcher, checkpoint_keep=1)
    run = start(job)
    keeper = agent_of(run.node)
    for step in (10, 20, 30):
        path, digest = write_checkpoint(Path(checkpoint_dir(job)), step, job=job)
        report(keeper, run, commit_event(path, digest, step))
    assert services.retention_apply()["collected"] == 0  # none checked yet
    keeper.poll_once()
    assert services.retention_apply()["collected"] == 2
    assert _registered(job, "verified") == {30}


def test_a_failed_deletion_is_retried_and_ends_consistent(
    fleet_pool, quota, team, researcher, monkeypatch, settings
):
    settings.CHECKPOINT_RETRY_S = 1
    job = submit_trainer(team, researcher, checkpoint_keep=1)
    run = start(job)
    keeper = agent_of(run.node)
    _commit(job, keeper, run, (10, 20))
    services.retention_apply()
    real_rmtree = agent_checkpoints.shutil.rmtree

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(agent_checkpoints.shutil, "rmtree", refuse)
    keeper.poll_once()
    copy = CheckpointCopy.objects.get(checkpoint__step=10)
    assert copy.state == "deleting" and "PermissionError" in copy.error and copy.attempts == 1
    assert _registered(job, "deleting") == {10} and 10 in _on_disk(job)
    _consistent(job)
    assert keeper.poll_once() == 0  # not offered again before its retry time

    monkeypatch.setattr(agent_checkpoints.shutil, "rmtree", real_rmtree)
    CheckpointCopy.objects.filter(pk=copy.pk).update(retry_after=timezone.now())
    keeper.poll_once()
    assert _registered(job, "deleted") == {10} and _on_disk(job) == {20}
    _consistent(job)


def test_a_directory_already_gone_counts_as_deleted(fleet_pool, quota, team, researcher):
    import shutil

    job = submit_trainer(team, researcher, checkpoint_keep=1)
    run = start(job)
    keeper = agent_of(run.node)
    _commit(job, keeper, run, (10, 20))
    services.retention_apply()
    shutil.rmtree(Path(checkpoint_dir(job)) / "step-00000010")  # someone got there first
    keeper.poll_once()
    (event,) = Checkpoint.objects.get(step=10).events.filter(to_state="deleted", copy__isnull=False)
    assert event.reason == "already gone from storage"
    assert _registered(job, "deleted") == {10}


def test_a_request_to_a_node_that_went_away_is_asked_of_another_that_mounts_the_storage(
    fleet_pool, quota, team, researcher
):
    from apps.fleet import services as fleet

    job = submit_trainer(team, researcher)
    run = start(job)
    path, digest = write_checkpoint(Path(checkpoint_dir(job)), 10, job=job)
    report(agent_of(run.node), run, commit_event(path, digest, 10))
    fleet.node_transition(node=run.node, to="suspect", reason="silent", by=None)
    assert services.requests_reoffer()["reoffered"] == 1
    copy = CheckpointCopy.objects.get()
    other = Node.objects.get(pk=copy.request_node_id)
    assert other != run.node and other.pool == run.node.pool
    agent_of(other).poll_once()
    assert Checkpoint.objects.get().state == "verified"


# --- S3 ---------------------------------------------------------------------------------------


@pytest.fixture
def s3(aws_endpoint, settings, team):
    settings.AWS_ENDPOINT_URL = aws_endpoint
    settings.AWS_REGION = "us-east-1"
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    bucket = f"ckpt-{team.pk}-{abs(hash(timezone.now())) % 10**6}"
    client.create_bucket(Bucket=bucket)
    S3Destination.objects.create(team=team, bucket=bucket, prefix="runs")
    return client, bucket, S3Store(endpoint_url=aws_endpoint, region="us-east-1")


def _run_json_s3(run) -> dict:
    import json

    (item,) = [f for f in run.plan["files"] if f["path"] == "run.json"]
    return json.loads(item["content"])["checkpoint"]["s3"]


def _copy_to_s3(job, run, keeper, step):
    """What the trainer does after a commit with checkpoint.s3 set: upload, then its line."""
    target = S3Copy(**_run_json_s3(run))
    path = Path(checkpoint_dir(job)) / f"step-{step:08d}"
    copy_to_s3(path, target, step)
    uri = f"s3://{target.bucket}/{target.prefix}/{path.name}"
    report(keeper, run, {"event": "checkpoint_copy", "step": step, "uri": uri, "time": 1.8e9})
    return uri


def test_s3_copies_are_verified_before_anything_older_is_deleted(
    fleet_pool, quota, team, researcher, s3
):
    from apps.jobs.dispatch import run_report
    from apps.jobs.scheduler.run import scheduling_pass
    from workers.tasks.jobs import dispatch_one

    client, bucket, store = s3
    job = submit_trainer(team, researcher, checkpoint_keep=1)
    scheduling_pass()
    assert dispatch_one(job.pk) == "dispatched"
    run = Run.objects.get(job=job)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 1})
    assert _run_json_s3(run) == {
        "bucket": bucket,
        "prefix": f"runs/{team.slug}/job-{job.pk}",
        "endpoint_url": store.client.meta.endpoint_url,
        "region": "us-east-1",
    }
    keeper = agent_of(run.node)
    _commit(job, keeper, run, (10,))
    _copy_to_s3(job, run, keeper, 10)
    s3_copies_verify(store=store)
    _commit(job, keeper, run, (20,))
    assert Checkpoint.objects.get(step=20).s3_expected

    # Step 20 is verified on shared storage, but its S3 copy is not made yet: 10 stays.
    assert services.retention_apply()["collected"] == 0
    uri = _copy_to_s3(job, run, keeper, 20)
    assert services.retention_apply()["collected"] == 0  # made, not yet checked
    assert s3_copies_verify(store=store) == {"verified": 1, "corrupt": 0, "later": 0, "refused": 0}
    assert services.retention_apply()["collected"] == 1

    keeper.poll_once()  # the shared copy of step 10
    assert s3_copies_delete(store=store) == {"deleted": 1, "gone": 0, "failed": 0, "refused": 0}
    assert _registered(job, "deleted") == {10}
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys and all("/step-00000020/" in key for key in keys)
    assert CheckpointCopy.objects.get(location=uri).state == "verified"


def test_s3_deletion_failing_then_already_gone_ends_consistent(
    fleet_pool, quota, team, researcher, s3
):
    from botocore.config import Config

    _client, bucket, store = s3
    job = submit_trainer(team, researcher, checkpoint_keep=1)
    run = start(job, checkpoint_s3=_s3_settings(job, bucket, store))
    keeper = agent_of(run.node)
    for step in (10, 20):
        _commit(job, keeper, run, (step,))
        _copy_to_s3(job, run, keeper, step)
    s3_copies_verify(store=store)
    services.retention_apply()
    keeper.poll_once()

    unreachable = S3Store(
        client=boto3.client(
            "s3",
            endpoint_url="http://127.0.0.1:9",
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2),
        )
    )
    assert s3_copies_delete(store=unreachable)["failed"] == 1
    copy = CheckpointCopy.objects.get(kind="s3", checkpoint__step=10)
    assert copy.state == "deleting" and copy.attempts == 1 and copy.error
    assert Checkpoint.objects.get(step=10).state == "deleting"  # its S3 objects are still there
    assert s3_copies_delete(store=store)["deleted"] == 0  # not before its retry time

    store.delete(copy.location)  # gone meanwhile, by a lifecycle rule say
    CheckpointCopy.objects.filter(pk=copy.pk).update(retry_after=timezone.now())
    assert s3_copies_delete(store=store) == {"deleted": 0, "gone": 1, "failed": 0, "refused": 0}
    assert Checkpoint.objects.get(step=10).state == "deleted"


def _s3_settings(job, bucket, store):
    return {
        "bucket": bucket,
        "prefix": f"runs/{job.team.slug}/job-{job.pk}",
        "endpoint_url": store.client.meta.endpoint_url,
        "region": "us-east-1",
    }


def test_an_s3_copy_survives_the_node_local_copys_deletion_and_resumes_elsewhere(
    fleet_pool, quota, team, researcher, s3, settings, client
):
    settings.CHECKPOINT_ROOT_SHARED = False  # each node's own disk
    _, bucket, store = s3
    job = submit_trainer(team, researcher)
    run = start(job, checkpoint_s3=_s3_settings(job, bucket, store))
    keeper = agent_of(run.node)
    _commit(job, keeper, run, (10,))
    uri = _copy_to_s3(job, run, keeper, 10)
    s3_copies_verify(store=store)
    checkpoint = Checkpoint.objects.get()
    local = checkpoint.copies.get(kind="node_local")
    assert local.node_id == run.node_id and local.state == "verified"

    client.force_login(researcher)
    answer = client.delete(
        f"/api/v1/checkpoint-copies/{local.pk}/", content_type="application/json"
    )
    assert answer.status_code == 202, answer.content
    keeper.poll_once()  # the node's agent deletes its directory
    assert not Path(local.location).exists()
    assert CheckpointCopy.objects.get(pk=local.pk).state == "deleted"
    checkpoint.refresh_from_db()
    assert checkpoint.state == "verified"  # through its S3 copy
    last = client.delete(
        f"/api/v1/checkpoint-copies/{checkpoint.copies.get(kind='s3').pk}/",
        content_type="application/json",
    )
    assert last.status_code == 409  # its last usable copy: delete the checkpoint instead

    # The job moves to another node: node-local copies elsewhere are out of reach, S3 is not.
    from tests.apps.checkpoints.test_registry import _placed_node, _requeue_and_place

    Node.objects.filter(pk=run.node_id).update(state="draining")
    _requeue_and_place(job)
    new_node = _placed_node(job)
    assert new_node.pk != run.node_id
    services.checkpoint_resume_prepare(job_id=job.pk)
    agent_of(new_node).poll_once()  # its own directory for this job: empty
    plan = services.checkpoint_resume_prepare(job_id=job.pk)
    assert (plan.wait, plan.resume_from, plan.step) == (False, uri, 10)


def test_node_local_copies_resume_only_on_their_node(fleet_pool, quota, team, researcher, settings):
    settings.CHECKPOINT_ROOT_SHARED = False
    job = submit_trainer(team, researcher)
    run = start(job)
    keeper = agent_of(run.node)
    _commit(job, keeper, run, (10,))
    from tests.apps.checkpoints.test_registry import _placed_node, _requeue_and_place

    Node.objects.exclude(pk=run.node_id).update(state="draining")  # only its node is free
    _requeue_and_place(job)
    assert _placed_node(job).pk == run.node_id
    services.checkpoint_resume_prepare(job_id=job.pk)
    keeper.poll_once()
    plan = services.checkpoint_resume_prepare(job_id=job.pk)
    assert plan.step == 10 and plan.resume_from.startswith(str(Path(checkpoint_dir(job))))

    # Placed elsewhere, it would start over: the copy is on another node's disk.
    job.refresh_from_db()
    from apps.jobs.services import job_transition

    job_transition(job=job, to="pending", reason="again", by=None)
    Node.objects.filter(pk=run.node_id).update(state="draining")
    Node.objects.exclude(pk=run.node_id).update(state="ready")
    from apps.jobs.scheduler.run import scheduling_pass

    scheduling_pass()
    other = _placed_node(job)
    assert other.pk != run.node_id
    # Local nodes share this machine's disk; the other node's own disk holds nothing.
    directory = Path(checkpoint_dir(job))
    directory.rename(directory.with_name("first-nodes-disk"))
    services.checkpoint_resume_prepare(job_id=job.pk)
    agent_of(other).poll_once()
    plan = services.checkpoint_resume_prepare(job_id=job.pk)
    assert plan.resume_from is None and not plan.wait
    assert Checkpoint.objects.get().copies.get().state == "verified"  # still there, on its node
    assert dt.timedelta(0) <= timezone.now() - Checkpoint.objects.get().offered_at


def test_a_finished_jobs_directory_is_swept_once_from_its_writer_in_fixed_reads(
    fleet_pool, quota, team, researcher
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.checkpoints.models import StorageSweep
    from apps.checkpoints.services.gc import finished_jobs_sweep
    from apps.jobs.dispatch import run_report

    def finished(count):
        runs = []
        for _ in range(count):
            run = start(submit_trainer(team, researcher))
            report = {"state": "exited", "exit_code": 0}
            run_report(node_id=run.node_id, run_id=run.pk, report=report)
            runs.append(run)
        return runs

    def reads_of_a_pass(expected):
        with CaptureQueriesContext(connection) as counted:
            assert finished_jobs_sweep() == {"swept": expected}
        return [q["sql"] for q in counted.captured_queries if q["sql"].startswith("SELECT")]

    one = finished(1)
    reads = reads_of_a_pass(1)
    many = finished(3)
    more = reads_of_a_pass(3)
    assert len(more) == len(reads) == 3  # the jobs (and teams), their writers, the live nodes
    for run in one + many:
        (sweep,) = StorageSweep.objects.filter(job=run.job)
        assert (sweep.node_id, sweep.why, sweep.tidy) == (run.node_id, "after the job ended", True)
    assert finished_jobs_sweep() == {"swept": 0}  # each finished job is listed once
