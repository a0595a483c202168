"""Checkpoints end to end, with the real trainer under torchrun (CPU, gloo) on local nodes whose
agents are real processes: the registry fills as the trainer commits; a node killed mid-run
(agent and processes) sends its job elsewhere, resuming from its newest verified checkpoint;
a preempted job whose newest checkpoint rotted on disk falls back to the one before and its
loss curve carries on; afterwards registry, storage and pages agree.

The tiny preset for 60 steps, a checkpoint every 10: about a quarter of a second a step
here, so the runs last seconds and their start (torch's import) most of that.
"""

import json
import os
import signal
from pathlib import Path

import pytest
from django.test import Client

from apps.checkpoints.models import Checkpoint, CheckpointCopy, StorageSweep
from apps.jobs import services as jobs
from apps.jobs.models import Job, Run, StepMetric
from apps.jobs.runconfig import checkpoint_dir
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import wait_for
from tests.e2e.test_faults import _agent_pid, _node_state
from workers.tasks.checkpoints import collect_run
from workers.tasks.fleet import heartbeat_sweep
from workers.tasks.jobs import dispatch_one

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

STEPS, INTERVAL = 60, 10


def _spec(team) -> dict:
    return {
        "name": "tiny-checkpointed",
        "team": team.pk,
        "time_limit_s": 900,
        "restart_limit": 3,
        "trainer": {
            "preset": "tiny",
            "dataset": "synthetic",
            "steps": STEPS,
            "global_batch": 4,
            "seq_len": 64,
            "precision": "fp32",
            "checkpoint_every_steps": INTERVAL,
            "checkpoint_keep": 2,
        },
        "resources": {"gpu_type": "H100", "nodes": 1, "gpus_per_node": 2},
        "placement": {"where": "owned"},
    }


def _dispatch(job) -> None:
    """What the jobs.dispatch task does, asked again while the new nodes check checkpoints."""
    scheduling_pass()
    wait_for("the job to be dispatched", lambda: dispatch_one(job.pk) == "dispatched", 90, 1.0)


def _verified_at_least(job, step: int) -> Checkpoint:
    return wait_for(
        f"a verified checkpoint at step {step} or later",
        lambda: (
            Checkpoint.objects.filter(job=job, state="verified", step__gte=step)
            .order_by("-step")
            .first()
        ),
        timeout_s=240,
        every_s=0.5,
    )


def _committed_on_disk(job) -> dict[int, str]:
    """Step → directory of every committed checkpoint on storage (a manifest makes one)."""
    directory = Path(checkpoint_dir(job))
    return {
        json.loads((p / "manifest.json").read_text())["step"]: p.name
        for p in directory.glob("step-*")  # a .tmp-step-… may hold a manifest not yet renamed
        if (p / "manifest.json").is_file()
    }


def _events(api, job, kind: str) -> list[dict]:
    lines = api.get(f"/api/v1/jobs/{job.pk}/logs/?limit=1000").json()["lines"]
    found = []
    for line in lines:
        if line["text"].startswith("{"):
            event = json.loads(line["text"])
            if event.get("event") == kind:
                found.append({**event, "attempt": line["attempt"]})
    return found


def _losses(job, attempt: int) -> dict[int, float]:
    return dict(StepMetric.objects.filter(job=job, attempt=attempt).values_list("step", "loss"))


def _settled(job) -> bool:
    """GC and sweeps done: nothing asked of an agent, nothing half-deleted, sweeps answered."""
    collect_run()
    busy = CheckpointCopy.objects.filter(checkpoint__job=job).exclude(request="").exists()
    deleting = Checkpoint.objects.filter(job=job, state="deleting").exists()
    sweeping = StorageSweep.objects.filter(job=job, reported_at__isnull=True).exists()
    return not (busy or deleting or sweeping)


def _assert_registry_storage_and_page_agree(job, user) -> None:
    on_disk = {p.name for p in Path(checkpoint_dir(job)).iterdir()}
    present = {
        Path(c.location).name: c
        for c in CheckpointCopy.objects.filter(
            checkpoint__job=job, state__in=["committed", "verified", "corrupt"]
        ).select_related("checkpoint")
    }
    assert set(present) == on_disk, (sorted(present), sorted(on_disk))
    for name, copy in present.items():  # and each copy's row says what is in it
        manifest = json.loads((Path(checkpoint_dir(job)) / name / "manifest.json").read_text())
        assert manifest["step"] == copy.checkpoint.step
    gone = CheckpointCopy.objects.filter(checkpoint__job=job, state="deleted")
    assert all(not Path(c.location).exists() for c in gone)
    browser = Client()
    browser.force_login(user)
    panel = browser.get(f"/checkpoints/jobs/{job.pk}/").content.decode()
    for checkpoint in Checkpoint.objects.filter(job=job):
        assert f'data-step="{checkpoint.step}" data-state="{checkpoint.state}"' in panel
    listed = browser.get("/checkpoints/").content.decode()
    newest = Checkpoint.objects.filter(job=job).exclude(state="deleted").order_by("-step").first()
    row = listed[listed.index(f'data-job="{job.pk}"') :]
    assert f">{newest.step}<" in row[: row.index("</tr>")]


def test_a_killed_nodes_job_resumes_elsewhere_from_its_newest_verified_checkpoint(
    local_nodes, e2e_team, api_for, settings, tmp_path
):
    settings.NODE_SUSPECT_AFTER_S = 2
    settings.NODE_DOWN_AFTER_S = 5
    pool = factories.make_owned_pool(slug="e2e-ckpt-kill")
    local_nodes(pool, count=2, gpus=2)
    member = factories.make_member(team=e2e_team)
    api = api_for(member, scopes=("submit",))
    answer = api.post("/api/v1/jobs/", _spec(e2e_team), format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    _dispatch(job)

    # Checkpoints appear in the registry as they are committed, and are verified.
    _verified_at_least(job, 2 * INTERVAL)
    first = Run.objects.get(job=job, attempt=1)
    assert first.pid
    lost_node = first.node
    os.killpg(first.pid, signal.SIGKILL)  # the machine is gone: its trainer...
    os.killpg(_agent_pid(lost_node), signal.SIGKILL)  # ...and its agent
    wait_for(
        "the node to be down and its job requeued",
        lambda: (
            heartbeat_sweep() is not None
            and _node_state(lost_node) == "down"
            and Job.objects.get(pk=job.pk).state == "pending"
        ),
        timeout_s=60,
        every_s=1.0,
    )
    # Read storage only now: a SIGKILL lands asynchronously, and a rename the trainer had
    # under way when it was sent still completes (CI once saw step 30 appear after the kill).
    on_disk = _committed_on_disk(job)
    newest_on_disk = max(on_disk)
    reached = max(_losses(job, 1))
    assert newest_on_disk >= reached - INTERVAL  # the trainer commits every INTERVAL steps
    _dispatch(job)
    second = Run.objects.get(job=job, attempt=2)
    assert second.node_id != lost_node.pk
    job = wait_for(
        "the resumed run to end",
        lambda: (j := Job.objects.get(pk=job.pk)).state in ("succeeded", "failed") and j,
        timeout_s=300,
        every_s=1.0,
    )
    assert job.state == "succeeded", job.state_reason

    # It resumed from the newest checkpoint on storage when the node died, verified from
    # the new node: no more than one interval of steps lost.
    (resume,) = _events(api, job, "resume")
    assert resume["step"] == newest_on_disk and resume["attempt"] == 2
    resumed_from = Checkpoint.objects.get(job=job, step=newest_on_disk, attempt=1)
    assert resumed_from.offered_at is not None
    started = job.events.filter(from_state="provisioning", to_state="starting").last()
    assert started.reason.endswith(f"checkpoint offered: {resumed_from.copies.first().location}")
    assert resumed_from.events.filter(reason__startswith="attempt 2 resumed from it").exists()
    assert job.events.filter(
        reason=f"attempt 2 resumed from step {newest_on_disk} ({resume['path']})"
    ).exists()  # the job's own timeline says what the trainer took
    assert reached - resume["step"] <= INTERVAL
    again = _losses(job, 2)
    assert min(again) == newest_on_disk + 1 and max(again) == STEPS
    before = _losses(job, 1)
    for step in set(again) & set(before):  # the same steps again: the same losses
        assert abs(again[step] - before[step]) < 1e-3, step

    wait_for("GC and sweeps to settle", lambda: _settled(job), timeout_s=60, every_s=1.0)
    kept = set(
        Checkpoint.objects.filter(job=job).exclude(state="deleted").values_list("step", flat=True)
    )
    assert {STEPS, STEPS - INTERVAL} <= kept  # the newest two (checkpoint_keep) and the final
    assert len(kept) <= 3  # ...and at most the one it resumed from, if still pinned
    _assert_registry_storage_and_page_agree(job, member)


def test_a_preempted_job_whose_newest_checkpoint_rotted_resumes_from_the_one_before(
    local_nodes, e2e_team, api_for, settings, tmp_path
):
    pool = factories.make_owned_pool(slug="e2e-ckpt-preempt")
    local_nodes(pool, count=1, gpus=2)
    member = factories.make_member(team=e2e_team)
    api = api_for(member, scopes=("submit",))
    answer = api.post("/api/v1/jobs/", _spec(e2e_team), format="json")
    job = Job.objects.get(pk=answer.json()["id"])
    _dispatch(job)
    _verified_at_least(job, 2 * INTERVAL)

    jobs.job_requeue(job=job, by=member, reason="make room")  # SIGTERM: checkpoint, then stop
    wait_for("the job to stop", lambda: Job.objects.get(pk=job.pk).state == "pending", 120, 0.5)
    stopped_at = Run.objects.get(job=job, attempt=1).status["step"]
    newest = wait_for(
        "the stop's checkpoint to be verified",
        lambda: Checkpoint.objects.filter(job=job, step=stopped_at, state="verified").first(),
        timeout_s=60,
    )
    before = (
        Checkpoint.objects.filter(job=job, step__lt=stopped_at, state="verified")
        .order_by("-step")
        .first()
    )
    shard = max(Path(newest.copies.get().location).glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a truncated file
    # Asking for a check is a write on the checkpoint: an admin-scoped token's.
    checked = api_for(member, scopes=("admin",)).post(f"/api/v1/checkpoints/{newest.pk}/verify/")
    assert checked.status_code == 202
    wait_for(
        "verification to catch it",
        lambda: Checkpoint.objects.get(pk=newest.pk).state == "corrupt",
        timeout_s=60,
    )

    _dispatch(job)
    job = wait_for(
        "the resumed run to end",
        lambda: (j := Job.objects.get(pk=job.pk)).state in ("succeeded", "failed") and j,
        timeout_s=300,
        every_s=1.0,
    )
    assert job.state == "succeeded", job.state_reason
    (resume,) = _events(api, job, "resume")
    assert resume["step"] == before.step  # not the corrupt one, and nothing older
    assert not _events(api, job, "checkpoint_rejected")  # the control plane never named it
    first, again = _losses(job, 1), _losses(job, 2)
    assert min(again) == before.step + 1
    for step in range(before.step + 1, stopped_at + 1):  # the curve carries on, step for step
        assert abs(again[step] - first[step]) < 1e-3, step
    assert again[STEPS] < first[1]

    wait_for("GC and sweeps to settle", lambda: _settled(job), timeout_s=60, every_s=1.0)
    assert Checkpoint.objects.get(pk=newest.pk).state == "deleted"  # corrupt, and superseded
    _assert_registry_storage_and_page_agree(job, member)
