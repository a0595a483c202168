"""The checkpoints API with real tokens: team scoping (other teams' jobs answer 404), filters,
deletion and verification through the services, storage per team, S3 destinations (ops), and
the watch, in the checkpoint API and in the job's detail."""

import datetime as dt
from pathlib import Path

import pytest
from django.utils import timezone

from apps.accounts import services as accounts
from apps.checkpoints.models import Checkpoint, S3Destination
from apps.jobs.models import Job, Run, StepMetric
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

pytestmark = pytest.mark.django_db


@pytest.fixture
def checkpointed(running_job):
    """The running job with verified checkpoints at steps 10 and 20."""
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    for step in (10, 20):
        path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), step, job=running_job)
        report(keeper, run, commit_event(path, digest, step))
    keeper.poll_once()
    return running_job


@pytest.fixture
def outsider(other_team):
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    return factories.make_member(team=other_team, role="researcher")


def test_a_teams_checkpoints_are_listed_with_their_copies(checkpointed, researcher, api_for):
    api = api_for(researcher, scopes=("read",))
    rows = api.get(f"/api/v1/checkpoints/?job_id={checkpointed.pk}").json()["results"]
    assert [r["step"] for r in rows] == [20, 10]
    assert rows[0]["state"] == "verified" and rows[0]["copies"][0]["kind"] == "shared"
    assert api.get("/api/v1/checkpoints/?step_min=15").json()["count"] == 1
    assert api.get("/api/v1/checkpoints/?state=corrupt").json()["count"] == 0
    detail = api.get(f"/api/v1/checkpoints/{rows[0]['id']}/").json()
    assert [e["to_state"] for e in detail["events"]][:2] == ["committed", "verified"]
    copies = api.get(f"/api/v1/checkpoint-copies/?job_id={checkpointed.pk}").json()
    assert copies["count"] == 2


def test_another_teams_checkpoints_do_not_exist(checkpointed, outsider, api_for):
    api = api_for(outsider, scopes=("admin",))
    checkpoint = Checkpoint.objects.first()
    assert api.get("/api/v1/checkpoints/").json()["count"] == 0
    assert api.get(f"/api/v1/checkpoints/{checkpoint.pk}/").status_code == 404
    assert api.delete(f"/api/v1/checkpoints/{checkpoint.pk}/").status_code == 404
    assert api.post(f"/api/v1/checkpoints/{checkpoint.pk}/verify/").status_code == 404
    copy = checkpoint.copies.get()
    assert api.delete(f"/api/v1/checkpoint-copies/{copy.pk}/").status_code == 404
    assert api.get(f"/api/v1/checkpoint-jobs/{checkpointed.pk}/").status_code == 404
    assert api.get("/api/v1/checkpoint-storage/").json() == []
    assert Checkpoint.objects.filter(state="verified").count() == 2


def test_deleting_is_storage_first_and_never_the_point_it_resumes_from(
    checkpointed, researcher, api_for
):
    api = api_for(researcher, scopes=("admin",))
    newest, older = Checkpoint.objects.order_by("-step")
    # Deleting stored work needs an admin token: a CI pipeline's submit token cannot.
    submit_only = api_for(researcher, scopes=("submit",)).delete(f"/api/v1/checkpoints/{older.pk}/")
    assert (
        submit_only.status_code == 403 and Checkpoint.objects.get(pk=older.pk).state != "deleting"
    )
    refused = api.delete(f"/api/v1/checkpoints/{newest.pk}/")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "in_use"
    answer = api.delete(f"/api/v1/checkpoints/{older.pk}/", {"reason": "bad run"}, format="json")
    assert answer.status_code == 202 and answer.json()["state"] == "deleting"
    assert Path(older.copies.get().location).exists()
    agent_of(Run.objects.get(job=checkpointed).node).poll_once()
    assert Checkpoint.objects.get(pk=older.pk).state == "deleted"
    assert not Path(older.copies.get().location).exists()
    assert (
        api_for(researcher, scopes=("read",))
        .delete(f"/api/v1/checkpoints/{newest.pk}/")
        .status_code
        == 403
    )  # a read token


def test_a_viewer_may_read_but_not_delete(checkpointed, viewer, api_for):
    api = api_for(viewer, scopes=("admin",))
    checkpoint = Checkpoint.objects.order_by("step").first()
    assert api.get(f"/api/v1/checkpoints/{checkpoint.pk}/").status_code == 200
    assert api.delete(f"/api/v1/checkpoints/{checkpoint.pk}/").status_code == 403
    assert api.post(f"/api/v1/checkpoints/{checkpoint.pk}/verify/").status_code == 403


def test_verify_asks_again_and_the_answer_comes_back(checkpointed, researcher, api_for):
    api = api_for(researcher, scopes=("admin",))
    checkpoint = Checkpoint.objects.order_by("-step").first()
    answer = api.post(f"/api/v1/checkpoints/{checkpoint.pk}/verify/")
    assert answer.status_code == 202
    assert checkpoint.copies.get().request == "verify"
    agent_of(Run.objects.get(job=checkpointed).node).poll_once()
    assert checkpoint.copies.get().request == ""


def test_storage_is_summed_per_team_and_kind(checkpointed, researcher, finance_user, api_for):
    size = sum(Checkpoint.objects.values_list("size_bytes", flat=True))
    (row,) = api_for(researcher, scopes=("read",)).get("/api/v1/checkpoint-storage/").json()
    assert row == {
        "team": checkpointed.team_id,
        "team_slug": "alpha",
        "node_local": 0,
        "shared": size,
        "s3": 0,
        "total": size,
        "copies": 2,
    }
    assert api_for(finance_user, scopes=("read",)).get("/api/v1/checkpoint-storage/").json()


def test_a_jobs_summary_shows_its_newest_and_the_checkpoint_it_would_resume_from(
    checkpointed, researcher, api_for
):
    api = api_for(researcher, scopes=("read",))
    summary = api.get(f"/api/v1/checkpoint-jobs/{checkpointed.pk}/").json()
    assert summary["newest"]["step"] == 20 and summary["newest_verified"]["step"] == 20
    assert summary["checkpoints"] == 2 and summary["size_bytes"] > 0
    assert summary["retention"] == {"keep_last": 3, "keep_every": None, "final_step": 100}
    listed = api.get("/api/v1/checkpoint-jobs/?newest_state=verified").json()
    assert [r["id"] for r in listed["results"]] == [checkpointed.pk]
    assert api.get("/api/v1/checkpoint-jobs/?newest_state=none").json()["count"] == 0
    for query in ("ordering=size_bytes", "ordering=-id", "overdue=maybe", "team_id=0", "page=9"):
        assert api.get(f"/api/v1/checkpoint-jobs/?{query}").status_code in (200, 400, 404), query
    # The page's "any state" option sends an empty value: no filter; a wrong one is a 400.
    assert api.get("/api/v1/checkpoint-jobs/?state=&newest_state=").json()["count"] == 1
    assert api.get("/api/v1/checkpoint-jobs/?state=&state=running").json()["count"] == 1
    assert api.get("/api/v1/checkpoint-jobs/?state=&state=pending").json()["count"] == 0
    wrong = api.get("/api/v1/checkpoint-jobs/?state=runing")
    assert wrong.status_code == 400 and "state" in wrong.json()["error"]["details"]
    detail = api.get(f"/api/v1/jobs/{checkpointed.pk}/").json()
    assert detail["checkpoints"]["newest_verified"]["step"] == 20
    assert detail["checkpoints"]["watch"]["overdue"] is False


def _steps(job, *, seconds_per_step: float, until: dt.datetime, count: int = 30):
    run = Run.objects.get(job=job)
    StepMetric.objects.bulk_create(
        StepMetric(
            job=job,
            attempt=run.attempt,
            step=s,
            at=until - dt.timedelta(seconds=seconds_per_step * (count - s)),
            loss=4.0,
        )
        for s in range(1, count + 1)
    )


def test_a_running_job_whose_last_verified_checkpoint_is_overdue_is_flagged(
    checkpointed, researcher, api_for
):
    now = timezone.now()
    # Every 10 steps at 6 s a step: one expected every minute; the last verified is 3 min old.
    Job.objects.filter(pk=checkpointed.pk).update(started_at=now - dt.timedelta(hours=1))
    Checkpoint.objects.filter(job=checkpointed).update(committed_at=now - dt.timedelta(minutes=3))
    _steps(checkpointed, seconds_per_step=6.0, until=now)
    api = api_for(researcher, scopes=("read",))

    watch = api.get(f"/api/v1/checkpoint-jobs/{checkpointed.pk}/").json()["watch"]
    assert watch["overdue"] is True
    assert watch["expected_interval_s"] == pytest.approx(60.0)
    assert 170 < watch["age_s"] < 200
    assert api.get("/api/v1/checkpoint-jobs/?overdue=true").json()["count"] == 1
    assert api.get(f"/api/v1/jobs/{checkpointed.pk}/").json()["checkpoints"]["watch"]["overdue"]

    # Within twice the interval it is on time; a job that is not running is never flagged.
    Checkpoint.objects.filter(job=checkpointed, step=20).update(
        committed_at=now - dt.timedelta(seconds=90)
    )
    assert not api.get(f"/api/v1/checkpoint-jobs/{checkpointed.pk}/").json()["watch"]["overdue"]
    assert api.get("/api/v1/checkpoint-jobs/?overdue=true").json()["results"] == []


def test_overdue_jobs_are_picked_before_the_page_is_cut(
    checkpointed, team, researcher, api_for, client
):
    now = timezone.now()
    Job.objects.filter(pk=checkpointed.pk).update(started_at=now - dt.timedelta(hours=1))
    Checkpoint.objects.filter(job=checkpointed).update(committed_at=now - dt.timedelta(minutes=3))
    _steps(checkpointed, seconds_per_step=6.0, until=now)
    for _ in range(2):  # newer running jobs, on time: they come first in the list
        start(submit_trainer(team, researcher))
    api = api_for(researcher, scopes=("read",))
    assert api.get("/api/v1/checkpoint-jobs/?state=running").json()["count"] == 3

    found = api.get("/api/v1/checkpoint-jobs/?overdue=true&page_size=1").json()
    assert found["count"] == 1 and [r["id"] for r in found["results"]] == [checkpointed.pk]
    client.force_login(researcher)
    page = client.get("/checkpoints/?overdue=on").content.decode()
    assert f'data-job="{checkpointed.pk}"' in page and page.count("data-job=") == 1


def test_every_minutes_sets_the_interval_without_step_times(
    fleet_pool, quota, team, researcher, api_for
):
    job = submit_trainer(team, researcher, checkpoint_every_steps=None, checkpoint_every_minutes=5)
    start(job)
    Job.objects.filter(pk=job.pk).update(started_at=timezone.now() - dt.timedelta(minutes=11))
    watch = api_for(researcher).get(f"/api/v1/checkpoint-jobs/{job.pk}/").json()["watch"]
    assert watch["overdue"] and watch["expected_interval_s"] == 300
    assert "no verified checkpoint since" in watch["reason"]


def test_a_command_jobs_detail_has_no_checkpoints(fleet_pool, quota, team, researcher, api_for):
    from apps.jobs import services as jobs
    from tests.apps.jobs.conftest import command_spec

    job, _ = jobs.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    assert api_for(researcher).get(f"/api/v1/jobs/{job.pk}/").json()["checkpoints"] is None


def test_only_ops_say_where_a_teams_copies_go(team, ops_user, researcher, api_for):
    body = {"team": team.pk, "bucket": "ml-checkpoints", "prefix": "/prod/"}
    denied = api_for(researcher).post("/api/v1/checkpoint-s3-destinations/", body, format="json")
    assert denied.status_code == 403
    made = api_for(ops_user).post("/api/v1/checkpoint-s3-destinations/", body, format="json")
    assert made.status_code == 201, made.content
    assert made.json()["prefix"] == "prod"
    again = api_for(ops_user).post("/api/v1/checkpoint-s3-destinations/", body, format="json")
    assert again.status_code == 400 and "team" in again.json()["error"]["details"]
    bad = api_for(ops_user).post(
        "/api/v1/checkpoint-s3-destinations/", {**body, "bucket": "Bad_Bucket"}, format="json"
    )
    assert bad.status_code == 400 and "bucket" in bad.json()["error"]["details"]
    neither = api_for(ops_user).post(
        "/api/v1/checkpoint-s3-destinations/", {"bucket": "ml-checkpoints"}, format="json"
    )
    assert neither.status_code == 400
    assert api_for(researcher).get("/api/v1/checkpoint-s3-destinations/").json()["count"] == 1
    destination = S3Destination.objects.get()
    patched = api_for(ops_user).patch(
        f"/api/v1/checkpoint-s3-destinations/{destination.pk}/",
        {"bucket": "ml-checkpoints-2"},
        format="json",
    )
    assert patched.status_code == 200 and patched.json()["bucket"] == "ml-checkpoints-2"
