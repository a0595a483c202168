"""The Checkpoints page, its CSV, and the checkpoint panel of a Job page (Django test client)."""

import csv
import datetime as dt
import io
from pathlib import Path

import pytest
from django.utils import timezone

from apps.accounts import services as accounts
from apps.checkpoints.models import Checkpoint
from apps.jobs.models import Job, Run
from apps.jobs.runconfig import checkpoint_dir
from tests import factories
from tests.apps.checkpoints.conftest import (
    agent_of,
    commit_event,
    report,
    submit_trainer,
    write_checkpoint,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def checkpointed(running_job):
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    for step in (10, 20, 30):
        path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), step, job=running_job)
        report(keeper, run, commit_event(path, digest, step))
    keeper.poll_once()
    (path / "__1_0.distcp").write_bytes(b"rot")  # step 30's
    from apps.checkpoints.services import checkpoint_verify_request

    checkpoint_verify_request(checkpoint=Checkpoint.objects.get(step=30), by=None)
    keeper.poll_once()
    return running_job


def test_the_page_lists_each_job_with_its_newest_checkpoint_and_storage_per_team(
    client, checkpointed, researcher, team, quota
):
    waiting = submit_trainer(team, researcher, steps=50)
    client.force_login(researcher)
    html = client.get("/checkpoints/").content.decode()
    assert '<a href="/checkpoints/">Checkpoints</a>' in html or 'href="/checkpoints/"' in html
    row = html[html.index(f'data-job="{checkpointed.pk}"') :]
    row = row[: row.index("</tr>")]
    assert ">30<" in row and "ckpt-corrupt" in row  # its newest, corrupt
    assert ">20<" in row  # the newest verified: what it would resume from
    assert "Shared: corrupt" in row
    other = html[html.index(f'data-job="{waiting.pk}"') :]
    assert "none yet" in other[: other.index("</tr>")]
    storage = html[html.index('id="storage-table"') :]
    assert 'data-team="alpha"' in storage
    filtered = client.get("/checkpoints/?newest_state=corrupt").content.decode()
    assert (
        f'data-job="{checkpointed.pk}"' in filtered and f'data-job="{waiting.pk}"' not in filtered
    )
    none_yet = client.get("/checkpoints/?newest_state=none").content.decode()
    assert (
        f'data-job="{waiting.pk}"' in none_yet and f'data-job="{checkpointed.pk}"' not in none_yet
    )


def test_the_csv_has_the_pages_rows_and_filters(client, checkpointed, researcher):
    client.force_login(researcher)
    answer = client.get("/checkpoints/checkpoints.csv?state=running")
    assert answer["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert len(rows) == 1
    assert rows[0]["job_id"] == str(checkpointed.pk)
    assert (rows[0]["newest_step"], rows[0]["newest_state"], rows[0]["verified_step"]) == (
        "30",
        "corrupt",
        "20",
    )
    assert rows[0]["newest_copies"] == "shared:corrupt"
    empty = client.get("/checkpoints/checkpoints.csv?state=succeeded").content.decode()
    assert len(empty.strip().splitlines()) == 1  # the header only


def test_another_teams_jobs_are_not_listed_and_their_panel_is_not_found(
    client, checkpointed, other_team
):
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=8, by=None)
    outsider = factories.make_member(team=other_team, role="researcher")
    client.force_login(outsider)
    assert f'data-job="{checkpointed.pk}"' not in client.get("/checkpoints/").content.decode()
    assert client.get(f"/checkpoints/jobs/{checkpointed.pk}/").status_code == 404
    assert client.get("/checkpoints/checkpoints.csv").content.decode().count("\n") == 1


def test_the_job_page_loads_its_checkpoint_panel_which_lists_every_checkpoint(
    client, checkpointed, researcher
):
    client.force_login(researcher)
    page = client.get(f"/jobs/{checkpointed.pk}/").content.decode()
    assert f'hx-get="/checkpoints/jobs/{checkpointed.pk}/"' in page
    panel = client.get(f"/checkpoints/jobs/{checkpointed.pk}/").content.decode()
    assert [int(s) for s in _steps(panel)] == [30, 20, 10]
    assert 'data-step="30" data-state="corrupt"' in panel
    assert "Resumes from</dt><dd>step 20" in panel
    assert 'hx-trigger="every 10s, live:resume"' in panel
    assert "checkpoint-overdue" not in panel
    Job.objects.filter(pk=checkpointed.pk).update(state="succeeded")
    assert "every 10s" not in client.get(f"/checkpoints/jobs/{checkpointed.pk}/").content.decode()


def _steps(html: str) -> list[str]:
    import re

    return re.findall(r'data-step="(\d+)"', html)


def test_an_overdue_job_is_called_out_on_its_page_and_in_the_list(client, checkpointed, researcher):
    now = timezone.now()
    Job.objects.filter(pk=checkpointed.pk).update(started_at=now - dt.timedelta(hours=1))
    Job.objects.filter(pk=checkpointed.pk).update(
        spec={
            **checkpointed.spec,
            "trainer": {
                **checkpointed.spec["trainer"],
                "checkpoint_every_steps": None,
                "checkpoint_every_minutes": 1,
            },
        }
    )
    Checkpoint.objects.filter(job=checkpointed).update(committed_at=now - dt.timedelta(minutes=5))
    client.force_login(researcher)
    panel = client.get(f"/checkpoints/jobs/{checkpointed.pk}/").content.decode()
    assert 'id="checkpoint-overdue"' in panel and "expected every 1.0 min" in panel
    listed = client.get("/checkpoints/?overdue=true").content.decode()
    assert f'data-job="{checkpointed.pk}"' in listed and ">overdue<" in listed


def test_the_page_makes_a_fixed_number_of_queries(
    client, checkpointed, researcher, team, django_assert_num_queries
):
    client.force_login(researcher)
    client.get("/checkpoints/")  # warm the session and roles
    with django_assert_num_queries(QUERIES) as counted:
        client.get("/checkpoints/")
    for n in range(3):  # more jobs with checkpoints: no more queries
        job = submit_trainer(team, researcher, steps=10 + n)
        _path, digest = write_checkpoint(Path(checkpoint_dir(job)), 10, job=job)
        Checkpoint.objects.create(
            job=job,
            team=team,
            attempt=1,
            step=10,
            manifest_sha256=digest,
            committed_at=timezone.now(),
        )
    with django_assert_num_queries(len(counted.captured_queries)):
        client.get("/checkpoints/")


# session, user, memberships, count, jobs, their checkpoints and copies, storage used by job,
# storage per team and its teams' slugs, teams, step times, budget banner
QUERIES = 13


def test_the_page_follows_changes_through_a_live_region_that_keeps_its_filters(
    client, checkpointed, researcher, team
):
    client.force_login(researcher)
    page = client.get("/checkpoints/", {"team_id": team.pk, "page": 1}).content.decode()
    assert (
        f'<div id="checkpoints-live" data-live hx-get="/checkpoints/live/?team_id={team.pk}'
        '&amp;page=1" hx-trigger="every 10s, live:resume" hx-swap="outerHTML">' in page
    )

    waiting = submit_trainer(team, researcher, steps=50)
    Job.objects.filter(pk=checkpointed.pk).update(state="succeeded")
    html = client.get("/checkpoints/live/", {"team_id": team.pk, "page": 1}).content.decode()

    assert html.lstrip().startswith('<div id="checkpoints-live" data-live')
    assert "<html" not in html
    row = html[html.index(f'data-job="{checkpointed.pk}"') :]
    assert "state-succeeded" in row[: row.index("</tr>")]
    assert f'data-job="{waiting.pk}"' in html
    # The head's count and the storage table come out of band.
    assert '<p class="muted" id="checkpoint-count" hx-swap-oob="true">2 training jobs match' in html
    assert '<section class="site" id="storage" aria-labelledby="storage-title" hx-swap-oob' in html
    other = client.get("/checkpoints/live/", {"team_id": 999_999}).content.decode()
    assert f'data-job="{checkpointed.pk}"' not in other


def test_the_live_region_makes_a_fixed_number_of_queries(
    client, checkpointed, researcher, team, django_assert_max_num_queries
):
    client.force_login(researcher)
    client.get("/checkpoints/live/")  # warm the session and roles
    for n in range(3):
        submit_trainer(team, researcher, steps=10 + n)
    # As the page's, less the filters' teams.
    with django_assert_max_num_queries(QUERIES - 1):
        html = client.get("/checkpoints/live/").content.decode()
    assert html.count("<tr data-job=") == 4
