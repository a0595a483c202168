"""The jobs pages through the Django test client: the Queue, its CSV, Submit and a job's page."""

import csv
import io
import re

import pytest

from apps.accounts import services as accounts
from apps.jobs import services
from apps.jobs.models import Job, JobState
from tests import factories
from tests.apps.jobs.conftest import command_spec, form_data

pytestmark = pytest.mark.django_db


def submit(team, user, **overrides):
    job, _ = services.job_submit(team=team, spec=command_spec(team, **overrides), submitted_by=user)
    return job


def logged_in(client, user):
    client.force_login(user)
    return client


def element_text(html: str, css_class: str) -> str:
    """The text inside the first element of our templates with this class."""
    match = re.search(rf'<(\w+) class="{css_class}"[^>]*>(.*?)</\1>', html, re.S)
    assert match, f"no .{css_class} in the page"
    return re.sub(r"<[^>]+>", " ", match.group(2))


def select_options(html: str, name: str) -> list[str]:
    match = re.search(rf'<select name="{name}"[^>]*>(.*?)</select>', html, re.S)
    assert match, f"no <select name={name}> in the page"
    return re.findall(r'<option value="([^"]*)"', match.group(1))


def test_the_queue_shows_own_jobs_by_name_and_others_anonymously(
    client, fleet_pool, quota, team, researcher, other_team, other_member
):
    mine = submit(team, researcher, name="alpha-pretrain")
    theirs = submit(other_team, other_member, name="beta-secret-run")

    response = logged_in(client, researcher).get("/jobs/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>Queue</h1>" in html
    assert f'<tr data-job="{mine.pk}"' in html
    assert "alpha-pretrain" in html
    assert f'href="/jobs/{mine.pk}/"' in html
    assert "waiting for the next scheduling pass" in html
    assert "another team&#x27;s job" in html or "another team's job" in html
    assert "beta-secret-run" not in html
    assert f'href="/jobs/{theirs.pk}/"' not in html
    assert '<tr data-job=""' in html


def test_the_queue_filters_by_team(
    client, fleet_pool, quota, team, researcher, other_team, other_member
):
    submit(team, researcher, name="alpha-pretrain")
    submit(other_team, other_member, name="beta-secret-run")

    html = logged_in(client, researcher).get("/jobs/", {"team": "beta"}).content.decode()

    assert "alpha-pretrain" not in html
    assert html.count("<tr data-job=") == 1


def test_the_queue_is_shown_a_page_at_a_time_with_its_filters_kept(
    client, monkeypatch, fleet_pool, quota, team, researcher, other_team, other_member
):
    from apps.jobs import views

    monkeypatch.setattr(views, "QUEUE_PAGE_SIZE", 2)
    for n in range(5):
        submit(team, researcher, name=f"alpha-{n}")
    submit(other_team, other_member, name="beta-secret-run")
    logged_in(client, researcher)

    first = client.get("/jobs/", {"team": "alpha"}).content.decode()
    assert first.count("<tr data-job=") == 2
    assert "5 active jobs match these filters" in first
    assert "Page 1 of 3" in first and "team=alpha&amp;page=2" in first
    last = client.get("/jobs/", {"team": "alpha", "page": 3}).content.decode()
    assert last.count("<tr data-job=") == 1 and "← Ahead in the queue" in last
    from apps.jobs.scheduler.run import scheduling_pass
    from apps.jobs.selectors import queue_for

    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    scheduling_pass()  # one placed, the rest ordered by the pass
    shown = []
    for page in (1, 2, 3):
        html = client.get("/jobs/", {"team": "alpha", "page": page}).content.decode()
        shown += [int(i) for i in re.findall(r'<tr data-job="(\d+)"', html)]
    # Each job on exactly one page, in the order of the whole queue.
    assert shown == [
        row["id"] for row in queue_for(user=researcher, jobs=Job.objects.filter(team__slug="alpha"))
    ]
    assert len(set(shown)) == 5
    assert client.get("/jobs/", {"page": "junk"}).status_code == 200  # the first page


def test_the_queue_csv_has_a_header_and_one_row_per_job(
    client, fleet_pool, quota, team, researcher, other_team, other_member
):
    mine = submit(team, researcher, name="alpha-pretrain")
    submit(other_team, other_member, name="beta-secret-run")

    response = logged_in(client, researcher).get("/jobs/queue.csv")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0][:4] == ["position", "id", "team", "name"]
    assert len(rows) == 3
    by_team = {row[2]: row for row in rows[1:]}
    assert by_team["alpha"][1:4] == [str(mine.pk), "alpha", "alpha-pretrain"]
    assert by_team["beta"][1] == "" and by_team["beta"][3] == ""
    assert "beta-secret-run" not in response.content.decode()


def finish(job, state, *, ran_s=None, finished_ago_s=0, reason="done"):
    """Move a job to a finished state as the run's end would (test set-up, by update)."""
    import datetime as dt

    from django.utils import timezone

    finished = timezone.now() - dt.timedelta(seconds=finished_ago_s)
    started = None if ran_s is None else finished - dt.timedelta(seconds=ran_s)
    Job.objects.filter(pk=job.pk).update(
        state=state, state_reason=reason, started_at=started, finished_at=finished
    )


def test_the_history_lists_finished_jobs_of_own_teams_latest_first(
    client, fleet_pool, quota, team, researcher, other_team, other_member
):
    older = submit(team, researcher, name="alpha-old")
    newer = submit(team, researcher, name="alpha-new")
    cancelled = submit(team, researcher, name="alpha-cancelled")
    still_pending = submit(team, researcher, name="alpha-pending")
    theirs = submit(other_team, other_member, name="beta-secret-run")
    finish(older, JobState.SUCCEEDED, ran_s=3725, finished_ago_s=600)
    finish(newer, JobState.FAILED, ran_s=75, finished_ago_s=60, reason="rank 3 exited 1")
    finish(cancelled, JobState.CANCELLED, finished_ago_s=300, reason="cancelled by alice")
    finish(theirs, JobState.SUCCEEDED, ran_s=10)

    html = logged_in(client, researcher).get("/jobs/history/").content.decode()

    assert "<h1>History</h1>" in html
    assert re.findall(r'<tr data-job="(\d+)"', html) == [
        str(newer.pk),
        str(cancelled.pk),
        str(older.pk),
    ]
    assert "beta-secret-run" not in html and f'data-job="{still_pending.pk}"' not in html
    assert "rank 3 exited 1" in html
    assert "1 h 02 m" in html and "1 m 15 s" in html and "did not run" in html
    assert select_options(html, "state") == ["", "cancelled", "failed", "succeeded"]
    assert select_options(html, "team") == ["", "alpha"]

    failed_only = logged_in(client, researcher).get("/jobs/history/?state=failed").content
    assert re.findall(r'<tr data-job="(\d+)"', failed_only.decode()) == [str(newer.pk)]
    # A state that is not a finished one matches nothing rather than everything.
    pending = logged_in(client, researcher).get("/jobs/history/?state=pending").content.decode()
    assert "No finished jobs match these filters." in pending


def test_the_history_csv_has_every_finished_row_with_how_long_it_ran(
    client, fleet_pool, quota, team, researcher, other_team, other_member
):
    job = submit(team, researcher, name="alpha-done")
    finish(job, JobState.SUCCEEDED, ran_s=90)
    finish(submit(other_team, other_member, name="beta-secret-run"), JobState.SUCCEEDED)

    response = logged_in(client, researcher).get("/jobs/history.csv?team=alpha")

    assert response.status_code == 200
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0][:4] == ["id", "team", "name", "state"] and rows[0][-1] == "ran_s"
    assert len(rows) == 2
    assert rows[1][:4] == [str(job.pk), "alpha", "alpha-done", "succeeded"]
    assert rows[1][-1] == "90"
    assert "beta-secret-run" not in response.content.decode()


def test_the_queue_links_to_the_history(client, researcher):
    html = logged_in(client, researcher).get("/jobs/").content.decode()
    assert '<a class="button" href="/jobs/history/">History</a>' in html


def outlook_of(client, user, **params) -> str:
    query = {
        "gpu_type": "H100",
        "gpus": "16",
        "gpus_per_node": "8",
        "priority": "normal",
        "placement": "owned",
        "time_limit_hours": "2",
        **params,
    }
    response = logged_in(client, user).get("/jobs/submit/outlook/", query)
    assert response.status_code == 200
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", response.content.decode()))


def test_the_submit_forms_outlook_says_where_it_would_run_its_quota_the_jobs_ahead_and_cost(
    client, fleet_pool, quota, team, researcher
):
    from tests.apps.costs.conftest import owned_price

    owned_price(fleet_pool)
    submit(team, researcher, name="ahead")  # 8 H100, normal priority, pending

    text = outlook_of(client, researcher, team=str(team.pk))

    assert f"{fleet_pool.name}: 4 nodes with 8 GPUs free now" in text
    assert "there is room for it now" in text
    assert "the team holds 0 of its 32 H100 GPUs" in text and "with this job, 16." in text
    assert "1 pending job (8 GPUs) of this GPU type at this priority or higher" in text
    assert re.search(r"at most \$[\d,]+\.\d\d for the whole time limit \(32 GPU-hours", text)

    # Urgent: nothing of normal priority is ahead of it.
    assert "0 pending jobs of this GPU type" in outlook_of(
        client, researcher, team=str(team.pk), priority="urgent"
    )


def test_the_outlook_warns_of_a_quota_it_would_exceed_and_of_a_gang_no_pool_holds(
    client, fleet_pool, team, researcher, other_team
):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    over = outlook_of(client, researcher, team=str(team.pk))
    assert "with this job, 16: over its limit, so it waits" in over
    assert "no price is set for these pools yet" in over

    never = outlook_of(client, researcher, team=str(team.pk), gpus="64")
    assert "none can ever hold 8 × 8 H100 with this placement" in never
    assert "Room:" not in never

    # Another team's quota is not the researcher's to read.
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=64, by=None)
    assert "Quota:" not in outlook_of(client, researcher, team=str(other_team.pk))

    assert "once the resources above are valid" in outlook_of(client, researcher, gpus="12")
    assert "whole numbers" in outlook_of(client, researcher, gpus="eight")
    for hours in ("NaN", "Infinity", "-1"):
        assert "Pools:" not in outlook_of(client, researcher, time_limit_hours=hours)
    for team_id in ("²", "-3", "99999999999999999999"):
        assert "Quota:" not in outlook_of(client, researcher, team=team_id)


def test_the_submit_page_offers_the_layouts_that_fit(client, fleet_pool, quota, researcher):
    response = logged_in(client, researcher).get("/jobs/submit/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>Submit a job</h1>" in html
    assert '<span id="layout-choices">' in html
    options = select_options(html, "layout")
    assert options[0] == "" and "1x8x1x1" in options and "1x4x2x1" in options
    assert not any(value.split("x")[2] in ("4", "8") for value in options[1:])


def test_a_good_form_submits_a_pending_job(client, fleet_pool, quota, team, researcher):
    response = logged_in(client, researcher).post(
        "/jobs/submit/", form_data(team, layout="1x4x2x1")
    )

    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert (job.state, job.dp_shard, job.tp, job.time_limit_s) == (JobState.PENDING, 4, 2, 7200)


def field_errors(html: str, name: str) -> list[str]:
    """The errors shown beside one field of the Submit form."""
    start = html.index(f'name="{name}"')
    end = html.find('<div class="field', start)
    return re.findall(r'<span class="field-error">([^<]*)</span>', html[start:end])


def test_a_bad_layout_shows_the_error_and_makes_no_job(client, fleet_pool, quota, team, researcher):
    response = logged_in(client, researcher).post(
        "/jobs/submit/", form_data(team, layout="1x2x4x1")
    )

    assert response.status_code == 200
    html = response.content.decode()
    errors = field_errors(html, "layout")
    assert len(errors) == 1 and "tp 4 must divide the model&#x27;s 4 heads" in errors[0]
    assert 'class="form-errors"' not in html  # the service's error is on its field
    assert not Job.objects.exists()


def test_the_forms_spec_is_checked_by_the_apis_serializer_its_errors_on_the_fields(
    client, fleet_pool, quota, team, researcher
):
    response = logged_in(client, researcher).post(
        "/jobs/submit/",
        form_data(team, gpus=128, gpus_per_node=65, time_limit_hours="0.001", steps=-1),
    )

    assert response.status_code == 400  # the layouts part says the counts are refused too
    html = response.content.decode()
    assert field_errors(html, "gpus_per_node") == ["Ensure this value is less than or equal to 64."]
    assert field_errors(html, "time_limit_hours") == [
        "Ensure this value is greater than or equal to 60. "
        "In seconds (this field is in hours; 1 h = 3,600 s)."
    ]
    assert field_errors(html, "steps") == ["Ensure this value is greater than or equal to 1."]
    assert 'class="form-errors"' not in html
    assert not Job.objects.exists()


def test_a_viewer_gets_no_team_to_submit_for(client, fleet_pool, quota, team, viewer):
    html = logged_in(client, viewer).get("/jobs/submit/").content.decode()

    assert select_options(html, "team") == [""]
    assert "cannot submit jobs" in html

    response = client.post("/jobs/submit/", form_data(team))
    assert response.status_code == 200
    assert not Job.objects.exists()


def test_the_job_page_shows_the_summary_the_reason_and_the_timeline(
    client, fleet_pool, quota, team, researcher
):
    job = submit(team, researcher, name="alpha-pretrain")
    services.job_hold(job=job, by=researcher)
    services.job_release(job=job, by=researcher)

    response = logged_in(client, researcher).get(f"/jobs/{job.pk}/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "<h1>alpha-pretrain</h1>" in html
    assert "Why it waits" in html and "waiting for the next scheduling pass" in html
    timeline = re.search(r'<ol class="timeline[^"]*">(.*?)</ol>', html, re.S).group(1)
    assert timeline.count("<li") == 3
    assert "submitted" in timeline and f"held by {researcher.username}" in timeline
    assert f'action="/jobs/{job.pk}/hold/"' in html
    assert f'action="/jobs/{job.pk}/cancel/"' in html
    assert f'action="/jobs/{job.pk}/requeue/"' not in html


def test_cancel_from_the_job_page(client, fleet_pool, quota, team, researcher):
    job = submit(team, researcher)

    response = logged_in(client, researcher).post(f"/jobs/{job.pk}/cancel/", follow=True)

    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert response.redirect_chain[-1][0] == f"/jobs/{job.pk}/"
    html = response.content.decode()
    assert "Cancelled" in html and "cancel done" in html
    assert f'action="/jobs/{job.pk}/requeue/"' in html
    assert f'action="/jobs/{job.pk}/cancel/"' not in html


def test_cancel_from_the_queue_goes_back_to_the_queue(client, fleet_pool, quota, team, researcher):
    job = submit(team, researcher)

    response = logged_in(client, researcher).post(
        f"/jobs/{job.pk}/cancel/", {"next": "/jobs/?state=pending"}
    )

    assert response.status_code == 302 and response["Location"] == "/jobs/?state=pending"
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED


@pytest.mark.parametrize("jobs", [3, 20])
def test_the_queue_page_makes_a_bounded_number_of_queries(
    client, django_assert_max_num_queries, fleet_pool, quota, team, researcher, jobs
):
    for n in range(jobs):
        submit(team, researcher, name=f"job-{n}")
    logged_in(client, researcher)

    with django_assert_max_num_queries(15):
        response = client.get("/jobs/")

    assert response.content.decode().count("<tr data-job=") == jobs


@pytest.mark.parametrize("layout", ["bogus", "1x8", "1x0x1x1"])
def test_a_malformed_layout_is_a_form_error_not_a_crash(
    layout, client, fleet_pool, quota, team, researcher
):
    response = logged_in(client, researcher).post("/jobs/submit/", form_data(team, layout=layout))
    assert response.status_code == 200
    assert "Choose a layout" in response.content.decode()
    assert not Job.objects.exists()


def test_a_teammate_sees_no_buttons_on_someone_elses_job(
    client, fleet_pool, quota, team, researcher
):
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    teammate = factories.make_member(team=team, role="researcher")
    html = logged_in(client, teammate).get(f"/jobs/{job.pk}/").content.decode()
    assert f'action="/jobs/{job.pk}/cancel/"' not in html
    queue = client.get("/jobs/").content.decode()
    assert f'action="/jobs/{job.pk}/cancel/"' not in queue


def _ran(job, *, lines: list[str]):
    """A run of the job on a node of its pool, with output lines, as agents report them."""
    import datetime as dt

    from django.utils import timezone

    from apps.fleet.models import Node
    from apps.jobs.models import LogLine, Run

    node = Node.objects.filter(pool__slug="h100-owned").first()
    run = Run.objects.create(job=job, node=node, attempt=1, node_rank=0, plan={"argv": ["x"]})
    now = timezone.now()
    LogLine.objects.bulk_create(
        LogLine(run=run, job=job, seq=i, stream="stdout", at=now + dt.timedelta(seconds=i), text=t)
        for i, t in enumerate(lines)
    )
    return run


def test_a_jobs_page_shows_its_runs_and_output_and_follows_while_active(
    client, fleet_pool, quota, team, researcher, django_assert_max_num_queries
):
    job = submit(team, researcher, name="with-output")
    _ran(job, lines=[f"step {i} loss 2.{i}" for i in range(300)])
    logged_in(client, researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "step 299 loss 2.299" in page and "step 99 loss" not in page  # the last 200 lines
    assert 'id="runs-table"' in page
    assert "What ran (attempt 1, rank 0)" in page and '<pre class="spec">x</pre>' in page
    with django_assert_max_num_queries(12):
        tail = client.get(f"/jobs/{job.pk}/log-tail/").content.decode()
    assert re.search(r'id="log-poll"[^>]* data-live [^>]*hx-trigger="every 3s', tail)  # it asks
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    tail = client.get(f"/jobs/{job.pk}/log-tail/").content.decode()
    assert "data-live" not in tail and "step 299" in tail  # finished: it stops asking


def test_another_teams_output_is_not_found(
    client, fleet_pool, quota, team, researcher, other_member
):
    job = submit(team, researcher, name="private")
    _ran(job, lines=["secret research"])
    logged_in(client, other_member)
    assert client.get(f"/jobs/{job.pk}/log-tail/").status_code == 404


def test_a_trainer_jobs_page_draws_its_curves_from_the_reported_steps(
    client, fleet_pool, quota, team, researcher
):
    import json

    from apps.jobs.dispatch import run_logs_append
    from apps.jobs.models import StepMetric
    from tests.apps.jobs.conftest import trainer_spec

    job, _ = services.job_submit(
        team=team,
        spec=trainer_spec(
            team, preset="tiny", nodes=1, gpus_per_node=8, layout={"dp_shard": 8}, seq_len=256
        ),
        submitted_by=researcher,
    )
    run = _ran(job, lines=[])
    lines = [
        {"seq": i, "stream": "stdout", "at": 1.7e9 + i, "text": json.dumps(step)}
        for i, step in enumerate(
            [
                {"event": "step", "step": s, "loss": 5.0 - s * 0.1, "tokens_per_s": 900.0 + s}
                for s in range(1, 21)
            ]
        )
    ]
    lines.append({"seq": 99, "stream": "stdout", "at": 1.7e9, "text": '{"event":"step","step"'})
    run_logs_append(node_id=run.node_id, run_id=run.pk, lines=lines)
    run_logs_append(node_id=run.node_id, run_id=run.pk, lines=lines)  # an agent's retry
    assert StepMetric.objects.filter(job=job).count() == 20
    logged_in(client, researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert page.count("<polyline") == 2  # loss and tokens/s; no MFU on CPU
    assert "no data yet" not in page  # no chart waiting for MFU that will never come...
    assert "Model FLOPs utilisation: not reported" in page  # ...but why there is none
    assert re.search(r"<dt>Loss</dt><dd>3\.0+</dd>", page)
    panel = client.get(f"/jobs/{job.pk}/training/").content.decode()
    assert 'hx-trigger="every 5s, live:resume"' in panel

    StepMetric.objects.filter(job=job).update(mfu=0.41)  # steps on GPUs: MFU reported
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert page.count("<polyline") == 3 and "41%" in page
    assert "not reported" not in page
