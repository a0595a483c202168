"""A job's output is evidence of its own work, never an instruction: checkpoint paths and copy
URIs in what a job prints (relayed by the agent's real code) or in what an agent reports about
its directory must lie under that job's own directory or S3 prefix, or they are refused and
recorded and nothing else changes; the control plane deletes, verifies and resumes from only
what lies there, checked again before it touches storage (a moto server for S3)."""

from pathlib import Path

import boto3
import pytest
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.models import AuditEvent
from apps.checkpoints import services
from apps.checkpoints.models import Checkpoint, CheckpointCopy, S3Destination
from apps.jobs.models import Run
from apps.jobs.runconfig import checkpoint_dir
from tests import factories
from tests.apps.checkpoints.conftest import (
    agent_of,
    commit_event,
    report,
    start,
    submit_trainer,
    write_checkpoint,
)
from workers.providers.s3 import S3Store
from workers.tasks.checkpoints import s3_copies_delete, s3_copies_verify
from workers.trainer.checkpoint import copy_to_s3
from workers.trainer.config import S3Copy

pytestmark = pytest.mark.django_db
VISION_BUCKET = "vision-ckpt"


@pytest.fixture
def vision(other_team):
    """The other team ("beta"): its S3 destination, the one every user used to see."""
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    S3Destination.objects.create(team=other_team, bucket=VISION_BUCKET, prefix="v")
    return factories.make_member(team=other_team, role="researcher")


@pytest.fixture
def jobs(fleet_pool, quota, team, researcher, vision, other_team):
    """Running: `mine` (team alpha, copies to s3://alpha-ckpt/runs/), `sibling` (alpha too)
    and `theirs` (team beta, copies to s3://vision-ckpt/v/), each run told its S3 prefix by
    s3_copy_settings as dispatch tells it. Each has step 7 committed and verified."""
    S3Destination.objects.create(team=team, bucket="alpha-ckpt", prefix="runs")
    made = {}
    for name, (owner, by) in {
        "mine": (team, researcher),
        "sibling": (team, researcher),
        "theirs": (other_team, vision),
    }.items():
        job = submit_trainer(owner, by)
        run = start(job, checkpoint_s3=services.s3_copy_settings(job))
        keeper = agent_of(run.node)
        path, digest = write_checkpoint(Path(checkpoint_dir(job)), 7, job=job)
        report(keeper, run, commit_event(path, digest, 7))
        keeper.poll_once()
        made[name] = (job, run, keeper)
    return made


def _uri(job, step: int = 7) -> str:
    s3 = services.s3_copy_settings(job)
    return f"s3://{s3['bucket']}/{s3['prefix']}/step-{step:08d}"


def _copies_state() -> list[tuple]:
    return list(
        CheckpointCopy.objects.order_by("pk").values_list(
            "pk", "checkpoint_id", "location", "state", "request", "request_node_id"
        )
    )


def _refused(job) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action="checkpoint.output_refused", object_id=job.pk))


# --- the trainer's lines ---------------------------------------------------------------------


def _their_copy(jobs) -> CheckpointCopy:
    """`theirs` copied step 7 to its prefix, as its trainer reports it."""
    theirs, run, keeper = jobs["theirs"]
    report(keeper, run, {"event": "checkpoint_copy", "step": 7, "uri": _uri(theirs)})
    return CheckpointCopy.objects.get(location=_uri(theirs))


FORGED_URIS = {
    "another team's prefix": lambda j: _uri(j["theirs"][0]),
    "another job's prefix of the same team": lambda j: _uri(j["sibling"][0]),
    "a .. path": lambda j: _uri(j["mine"][0]).replace(
        f"job-{j['mine'][0].pk}/", f"job-{j['mine'][0].pk}/../../beta/job-{j['theirs'][0].pk}/"
    ),
    "a prefix extension": lambda j: _uri(j["mine"][0]).replace(
        f"job-{j['mine'][0].pk}/", f"job-{j['mine'][0].pk}0/"
    ),
    "a bucket that is not the destination's": lambda j: _uri(j["mine"][0]).replace(
        "s3://alpha-ckpt/", f"s3://{VISION_BUCKET}/"
    ),
    "the job's whole prefix": lambda j: _uri(j["mine"][0]).rsplit("/", 1)[0],
    "an empty part": lambda j: _uri(j["mine"][0]).replace("/step-", "//step-"),
}


@pytest.mark.parametrize("event", ["checkpoint_copy", "checkpoint_copy_failed"])
@pytest.mark.parametrize("forged", list(FORGED_URIS))
def test_a_copy_uri_outside_the_jobs_prefix_is_refused_recorded_and_changes_nothing(
    jobs, forged, event
):
    theirs = _their_copy(jobs)
    assert theirs.state == "committed" and theirs.request == "verify"
    mine, run, keeper = jobs["mine"]
    before = _copies_state()

    uri = FORGED_URIS[forged](jobs)
    report(keeper, run, {"event": event, "step": 7, "uri": uri, "message": "x"})

    assert keeper.outbox.refused == [(f"run {run.pk} {event} 7", 403)]
    assert _copies_state() == before  # no row written, none moved: theirs keeps its state
    (audit,) = _refused(mine)
    assert audit.after["field"] == "event.uri" and audit.after["run"] == run.pk
    assert audit.team_id == mine.team_id


def test_the_jobs_own_copy_is_still_recorded(jobs):
    mine, run, keeper = jobs["mine"]
    report(keeper, run, {"event": "checkpoint_copy", "step": 7, "uri": _uri(mine)})
    assert keeper.outbox.refused == []
    assert Checkpoint.objects.get(job=mine).copies.get(kind="s3").location == _uri(mine)


def _mine_dir(jobs) -> str:
    return checkpoint_dir(jobs["mine"][0])


FORGED_PATHS = {
    "another team's directory": lambda j: checkpoint_dir(j["theirs"][0]) + "/step-00000007",
    "another job's directory of the same team": (
        lambda j: checkpoint_dir(j["sibling"][0]) + "/step-00000007"
    ),
    "a .. path": lambda j: f"{_mine_dir(j)}/../../beta/job-{j['theirs'][0].pk}/step-00000007",
    "a prefix extension": lambda j: f"{_mine_dir(j)}0/step-00000007",
    "an absolute path outside CHECKPOINT_ROOT": lambda j: "/etc/step-00000007",
    "a relative path": lambda j: "step-00000007",
    "the job's directory itself": _mine_dir,
}


@pytest.mark.parametrize("forged", list(FORGED_PATHS))
def test_a_checkpoint_path_outside_the_jobs_directory_is_refused_recorded_and_changes_nothing(
    jobs, forged
):
    mine, run, keeper = jobs["mine"]
    path = FORGED_PATHS[forged](jobs)
    theirs_dir = Path(checkpoint_dir(jobs["theirs"][0])) / "step-00000007"
    digest = CheckpointCopy.objects.get(location=str(theirs_dir)).checkpoint.manifest_sha256
    before = (_copies_state(), Checkpoint.objects.count())

    event = {**commit_event(theirs_dir, digest, 8), "path": path}
    report(keeper, run, event)

    assert keeper.outbox.refused == [(f"run {run.pk} checkpoint 8", 403)]
    assert (_copies_state(), Checkpoint.objects.count()) == before
    (audit,) = _refused(mine)
    assert audit.after["field"] == "event.path" and audit.after["event"] == "checkpoint"


def _rejected(mine, theirs):
    return {"event": "checkpoint_rejected", "path": theirs.location, "reason": "bad"}


def _fetched(mine, theirs):
    return {
        "event": "checkpoint_fetched",
        "path": theirs.location,
        "uri": "s3://x/y/step-00000007",
        "manifest_sha256": theirs.checkpoint.manifest_sha256,
    }


def _resume(mine, theirs):
    return {"event": "resume", "step": 7, "path": theirs.location}


def _replaced(mine, theirs):
    """Mine's own step 7 saved again, its old directory said to be moved aside to theirs."""
    own = CheckpointCopy.objects.get(checkpoint__job=mine)
    path = Path(own.location)
    return {**commit_event(path, "d" * 64, 7), "replaced": theirs.location}


def _fetched_from(mine, theirs):
    """Fetched into mine's own directory, but from another job's S3 copy."""
    own = CheckpointCopy.objects.get(checkpoint__job=mine)
    return {
        "event": "checkpoint_fetched",
        "path": own.location,
        "uri": _uri(theirs.checkpoint.job),
        "manifest_sha256": own.checkpoint.manifest_sha256,
    }


@pytest.mark.parametrize("event", [_rejected, _fetched, _resume, _replaced, _fetched_from])
def test_reports_about_another_jobs_directory_are_refused(jobs, event):
    mine, run, keeper = jobs["mine"]
    theirs = CheckpointCopy.objects.get(checkpoint__job=jobs["theirs"][0])
    body = event(mine, theirs)
    before = (_copies_state(), Checkpoint.objects.count(), mine.events.count())

    report(keeper, run, body)

    assert [status for _, status in keeper.outbox.refused] == [403]
    assert (_copies_state(), Checkpoint.objects.count(), mine.events.count()) == before
    assert len(_refused(mine)) == 1


def test_a_sweep_registers_nothing_outside_the_jobs_directory(jobs):
    mine, run, _ = jobs["mine"]
    own = CheckpointCopy.objects.get(checkpoint__job=mine)
    theirs = CheckpointCopy.objects.get(checkpoint__job=jobs["theirs"][0])
    sweep = services.sweep_request(job=mine, node_id=run.node_id)

    def entry(copy, digest):
        return {
            "name": "step-00000007",
            "kind": "committed",
            "path": copy.location,
            "manifest_sha256": digest,
            "step": 7,
        }

    before = (_copies_state(), Checkpoint.objects.count())
    done = services.sweep_record(
        node_id=run.node_id,
        sweep_id=sweep.pk,
        report={
            "missing": False,
            "entries": [entry(own, own.checkpoint.manifest_sha256), entry(theirs, "e" * 64)],
            "removed": [],
        },
    )
    assert done.result["refused"] == 1 and done.result["adopted"] == 0
    assert (_copies_state(), Checkpoint.objects.count()) == before
    assert len(_refused(mine)) == 1


# --- storage is touched only under the job's own directory or prefix -----------------------------


@pytest.fixture
def s3(aws_endpoint, settings):
    settings.AWS_ENDPOINT_URL = aws_endpoint
    settings.AWS_REGION = "us-east-1"
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    for bucket in (VISION_BUCKET, "alpha-ckpt"):
        client.create_bucket(Bucket=bucket)
    return client, S3Store(endpoint_url=aws_endpoint, region="us-east-1")


def _copy_to_s3(job, run, keeper, step: int = 7) -> str:
    """What the trainer does after a commit with checkpoint.s3 set: upload, then its line."""
    target = S3Copy(**services.s3_copy_settings(job))
    copy_to_s3(Path(checkpoint_dir(job)) / f"step-{step:08d}", target, step)
    uri = _uri(job, step)
    report(keeper, run, {"event": "checkpoint_copy", "step": step, "uri": uri})
    return uri


def _commit_newer(jobs, step: int = 8) -> None:
    """A newer verified checkpoint of mine: step 7 is no longer the one it resumes from."""
    mine, run, keeper = jobs["mine"]
    path, digest = write_checkpoint(Path(checkpoint_dir(mine)), step, job=mine)
    report(keeper, run, commit_event(path, digest, step))
    keeper.poll_once()


def _delete_step_7(jobs, api_for, researcher) -> Checkpoint:
    checkpoint = Checkpoint.objects.get(job=jobs["mine"][0], step=7)
    answer = api_for(researcher, scopes=("admin",)).delete(
        f"/api/v1/checkpoints/{checkpoint.pk}/", {}, format="json"
    )
    assert answer.status_code == 202, answer.content
    jobs["mine"][2].poll_once()  # the agent deletes the directory
    return checkpoint


def _their_keys(client, job) -> set[str]:
    prefix = services.s3_copy_settings(job)["prefix"] + "/"
    listed = client.list_objects_v2(Bucket=VISION_BUCKET, Prefix=prefix)
    return {item["Key"] for item in listed.get("Contents", [])}


def test_the_reported_attack_leaves_the_other_teams_copy_and_objects_alone(
    jobs, s3, api_for, researcher
):
    client, store = s3
    theirs, their_run, their_keeper = jobs["theirs"]
    their_uri = _copy_to_s3(theirs, their_run, their_keeper)
    assert s3_copies_verify(store=store)["verified"] == 1
    their_copy = CheckpointCopy.objects.get(location=their_uri)
    assert their_copy.state == "verified"
    keys = _their_keys(client, theirs)
    assert keys

    mine, run, keeper = jobs["mine"]
    _copy_to_s3(mine, run, keeper)
    report(keeper, run, {"event": "checkpoint_copy", "step": 7, "uri": their_uri})
    assert keeper.outbox.refused == [(f"run {run.pk} checkpoint_copy 7", 403)]
    assert CheckpointCopy.objects.get(pk=their_copy.pk).state == "verified"

    _commit_newer(jobs)
    checkpoint = _delete_step_7(jobs, api_for, researcher)
    assert s3_copies_delete(store=store) == {"deleted": 1, "gone": 0, "failed": 0, "refused": 0}
    assert Checkpoint.objects.get(pk=checkpoint.pk).state == "deleted"
    assert _their_keys(client, theirs) == keys
    assert CheckpointCopy.objects.get(pk=their_copy.pk).state == "verified"


def _forged_row(checkpoint, location: str, *, kind: str) -> CheckpointCopy:
    """A row recorded before output was checked: this job's copy at another team's place."""
    return CheckpointCopy.objects.create(
        checkpoint=checkpoint, kind=kind, location=location, state="committed"
    )


def test_a_row_outside_the_jobs_prefix_is_refused_deletion_and_their_objects_stay(
    jobs, s3, api_for, researcher
):
    client, store = s3
    theirs, their_run, their_keeper = jobs["theirs"]
    _copy_to_s3(theirs, their_run, their_keeper)
    keys = _their_keys(client, theirs)
    mine = jobs["mine"][0]
    _commit_newer(jobs)
    checkpoint = Checkpoint.objects.get(job=mine, step=7)
    whole_prefix = _uri(theirs).rsplit("/", 1)[0]  # every object of theirs
    forged = _forged_row(checkpoint, whole_prefix, kind="s3")
    CheckpointCopy.objects.filter(pk=forged.pk).update(
        request="verify", requested_at=timezone.now()
    )
    assert s3_copies_verify(store=store)["refused"] == 1  # never read either
    forged.refresh_from_db()
    assert forged.state == "missing" and forged.request == ""
    _forged_row(checkpoint, whole_prefix + "/", kind="s3")  # the same, asked to delete

    _delete_step_7(jobs, api_for, researcher)
    assert s3_copies_delete(store=store) == {"deleted": 0, "gone": 0, "failed": 0, "refused": 1}

    assert _their_keys(client, theirs) == keys
    assert set(checkpoint.copies.filter(kind="s3").values_list("state", flat=True)) == {"missing"}
    assert "not under" in forged.events.order_by("-id").first().reason
    assert len(_refused(mine)) == 2


def test_a_deletion_already_asked_is_checked_again_before_s3_is_touched(jobs, s3):
    client, store = s3
    theirs, their_run, their_keeper = jobs["theirs"]
    _copy_to_s3(theirs, their_run, their_keeper)
    keys = _their_keys(client, theirs)
    checkpoint = Checkpoint.objects.get(job=jobs["mine"][0])
    forged = _forged_row(checkpoint, _uri(theirs).rsplit("/", 1)[0], kind="s3")
    CheckpointCopy.objects.filter(pk=forged.pk).update(
        state="deleting", request="delete", requested_at=timezone.now()
    )
    assert s3_copies_delete(store=store) == {"deleted": 0, "gone": 0, "failed": 0, "refused": 1}
    assert _their_keys(client, theirs) == keys
    assert CheckpointCopy.objects.get(pk=forged.pk).state == "missing"


def test_a_directory_outside_the_jobs_own_is_never_handed_to_an_agent_to_delete(jobs):
    mine, run, keeper = jobs["mine"]
    theirs = jobs["theirs"][0]
    # A committed checkpoint of theirs whose report never arrived, and a row of mine naming it
    # (recorded before output was checked), its digest and all.
    path, digest = write_checkpoint(Path(checkpoint_dir(theirs)), 9, job=theirs)
    forged = Checkpoint.objects.create(
        job=mine,
        team=mine.team,
        attempt=1,
        step=9,
        manifest_sha256=digest,
        committed_at=timezone.now(),
        state="deleting",
    )
    row = _forged_row(forged, str(path), kind="shared")
    CheckpointCopy.objects.filter(pk=row.pk).update(
        state="deleting", request="delete", request_node=run.node, requested_at=timezone.now()
    )
    before = [c for c in _copies_state() if c[0] != row.pk]

    keeper.poll_once()

    assert (path / "manifest.json").is_file()
    assert CheckpointCopy.objects.get(pk=row.pk).state == "missing"
    assert [c for c in _copies_state() if c[0] != row.pk] == before
    assert len(_refused(mine)) == 1


def test_resume_never_names_a_copy_outside_the_jobs_own_directory(jobs):
    from tests.apps.checkpoints.test_registry import _placed_node, _requeue_and_place

    mine = jobs["mine"][0]
    theirs = CheckpointCopy.objects.get(checkpoint__job=jobs["theirs"][0])
    mine_step7 = Checkpoint.objects.get(job=mine)
    newer = Checkpoint.objects.create(
        job=mine,
        team=mine.team,
        attempt=1,
        step=70,
        manifest_sha256=theirs.checkpoint.manifest_sha256,
        committed_at=timezone.now(),
        state="verified",
    )
    CheckpointCopy.objects.create(
        checkpoint=newer, kind="s3", location=_uri(jobs["theirs"][0]), state="verified"
    )
    _requeue_and_place(mine)
    services.checkpoint_resume_prepare(job_id=mine.pk)
    agent_of(_placed_node(mine)).poll_once()
    plan = services.checkpoint_resume_prepare(job_id=mine.pk)
    assert plan.checkpoint_id == mine_step7.pk, plan.reason


# --- who sees where copies go ----------------------------------------------------------------


def test_s3_destinations_are_seen_by_their_team_ops_and_finance_only(
    team, other_team, fleet_pool, researcher, viewer, ops_user, finance_user, superuser, api_for
):
    alpha = S3Destination.objects.create(team=team, bucket="alpha-ckpt", prefix="runs")
    beta = S3Destination.objects.create(team=other_team, bucket=VISION_BUCKET, prefix="v")
    pooled = S3Destination.objects.create(pool=fleet_pool, bucket="pool-ckpt")
    beta_viewer = factories.make_member(team=other_team, role="viewer")
    beta_researcher = factories.make_member(team=other_team, role="researcher")
    url = "/api/v1/checkpoint-s3-destinations/"

    def seen(user) -> set[int]:
        answer = api_for(user).get(url)
        assert answer.status_code == 200
        return {row["id"] for row in answer.json()["results"]}

    for user in (researcher, viewer):
        assert seen(user) == {alpha.pk}
        assert api_for(user).get(f"{url}{beta.pk}/").status_code == 404
        assert api_for(user).get(f"{url}{pooled.pk}/").status_code == 404
        assert api_for(user).get(f"{url}{alpha.pk}/").status_code == 200
    for user in (beta_viewer, beta_researcher):
        assert seen(user) == {beta.pk}
        assert api_for(user).get(f"{url}{alpha.pk}/").status_code == 404
    for user in (ops_user, finance_user, superuser):
        assert seen(user) == {alpha.pk, beta.pk, pooled.pk}
        assert api_for(user).get(f"{url}{beta.pk}/").json()["bucket"] == VISION_BUCKET


def test_another_teams_copies_and_their_uris_are_not_seen(jobs, vision, api_for):
    mine = jobs["mine"][0]
    copy = CheckpointCopy.objects.get(checkpoint__job=mine)
    client = api_for(vision)
    listed = client.get("/api/v1/checkpoint-copies/").json()["results"]
    assert copy.pk not in {row["id"] for row in listed}
    assert all(row["job"] == jobs["theirs"][0].pk for row in listed)
    assert client.get(f"/api/v1/checkpoint-copies/{copy.pk}/").status_code == 404
    assert client.get(f"/api/v1/checkpoints/{copy.checkpoint_id}/").status_code == 404
    assert Run.objects.filter(job=mine).exists()
