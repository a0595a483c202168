"""The Job page's live parts through the Django test client: its head (state, reason, the
actions the state allows, nodes) with the timeline and runs; the log viewer's filters,
search and polls; the whole-log download; jobs compared; and ranks counted in processes."""

import datetime as dt
import re

import pytest
from django.utils import timezone

from apps.fleet.models import Node
from apps.jobs import services
from apps.jobs.dispatch import job_dispatch, run_report
from apps.jobs.models import Job, JobState, LogLine, Run, StepMetric
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import command_spec, trainer_spec
from tests.apps.jobs.test_pages import logged_in, submit

pytestmark = pytest.mark.django_db


def actions(html: str) -> list[str]:
    return re.findall(r'data-action="(\w+)"', html)


def _run(job: Job, *, attempt: int = 1, rank: int = 0) -> Run:
    node = Node.objects.filter(pool__slug="h100-owned").order_by("pk")[rank]
    return Run.objects.create(
        job=job, node=node, attempt=attempt, node_rank=rank, plan={"argv": ["x"]}
    )


def _lines(run: Run, texts: list[str], *, first_seq: int = 0) -> list[LogLine]:
    now = timezone.now()
    return LogLine.objects.bulk_create(
        LogLine(
            run=run,
            job=run.job,
            seq=first_seq + i,
            stream="stdout",
            at=now + dt.timedelta(milliseconds=i),
            text=text,
        )
        for i, text in enumerate(texts)
    )


# --- the head ----------------------------------------------------------------------------------


def test_the_head_follows_the_job_and_offers_only_what_its_state_allows(
    client, fleet_pool, quota, team, researcher, django_assert_max_num_queries
):
    job = submit(team, researcher, name="live-head")
    logged_in(client, researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert re.search(r'id="job-live"[^>]* data-live hx-get="/jobs/\d+/live/"', page)
    assert actions(page) == ["cancel", "hold"]
    assert "Why it waits" in page

    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    with django_assert_max_num_queries(8):
        head = client.get(f"/jobs/{job.pk}/live/").content.decode()
    assert 'id="job-state"' in head and ">Starting<" in head
    assert actions(head) == ["cancel", "requeue"]
    assert "Why it waits" not in head
    # The timeline and the runs come with it, to replace the page's own (out of band).
    assert re.search(r'id="job-timeline" hx-swap-oob="true"', head)
    assert re.search(r'id="job-runs" hx-swap-oob="true"', head) and 'id="runs-table"' in head
    assert head.count('data-to="') == 4  # pending, admitted, provisioning, starting
    nodes = re.search(r'<dd id="job-nodes">(.*?)</dd>', head, re.S).group(1)
    assert Run.objects.get(job=job).node.name in nodes

    run = Run.objects.get(job=job)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 9})
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "exited", "exit_code": 0})
    with django_assert_max_num_queries(8):
        head = client.get(f"/jobs/{job.pk}/live/").content.decode()
    assert ">Succeeded<" in head and actions(head) == []  # a success is not run again
    assert "data-live" not in head.split(">", 1)[0]  # finished: the last render asks no more
    assert head.count('data-to="') == 6


def test_the_heads_query_count_does_not_grow_with_runs_and_events(
    client, fleet_pool, quota, team, researcher, django_assert_max_num_queries
):
    job = submit(team, researcher)
    for attempt in (1, 2, 3):
        for rank in range(4):
            _run(job, attempt=attempt, rank=rank)
    for _ in range(10):
        services.job_hold(job=job, by=researcher)
        services.job_release(job=job, by=researcher)
    logged_in(client, researcher)
    with django_assert_max_num_queries(8):
        head = client.get(f"/jobs/{job.pk}/live/").content.decode()
    assert head.count("<tr>") - 1 == 12  # every run (less the header row)


def test_a_failed_job_offers_requeue_and_another_team_gets_404(
    client, fleet_pool, quota, team, researcher, other_member
):
    job = submit(team, researcher)
    Job.objects.filter(pk=job.pk).update(state=JobState.FAILED, state_reason="exit code 3")
    html = logged_in(client, researcher).get(f"/jobs/{job.pk}/live/").content.decode()
    assert actions(html) == ["requeue"] and "exit code 3" in html
    logged_in(client, other_member)
    assert client.get(f"/jobs/{job.pk}/live/").status_code == 404


# --- the log viewer --------------------------------------------------------------------------


@pytest.fixture
def two_attempts(fleet_pool, quota, team, researcher):
    """A two-node job's output: attempt 1 on ranks 0 and 1, attempt 2 on rank 0."""
    job = submit(team, researcher, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    _lines(_run(job, attempt=1, rank=0), ["a1 r0 hello", "a1 r0 Loss 3.0"])
    _lines(_run(job, attempt=1, rank=1), ["a1 r1 hello", "a1 r1 loss 3.1"])
    _lines(_run(job, attempt=2, rank=0), ["a2 r0 hello", "a2 r0 LOSS 2.0"])
    return job


def _texts(html: str) -> list[str]:
    return [
        re.sub(r"<[^>]+>", "", t).split("] ", 1)[-1]
        for t in re.findall(r'<span class="log-line[^"]*" data-id="\d+">(.*?)</span>\n', html)
    ]


def test_the_log_viewer_filters_by_rank_attempt_and_text(
    client, two_attempts, researcher, django_assert_max_num_queries
):
    job = two_attempts
    logged_in(client, researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert len(_texts(page)) == 6
    assert re.findall(r'<select name="rank".*?</select>', page, re.S)[0].count("<option") == 3
    with django_assert_max_num_queries(8):
        html = client.get(f"/jobs/{job.pk}/log-tail/", {"rank": 1}).content.decode()
    assert _texts(html) == ["a1 r1 hello", "a1 r1 loss 3.1"]
    html = client.get(f"/jobs/{job.pk}/log-tail/", {"attempt": 2}).content.decode()
    assert _texts(html) == ["a2 r0 hello", "a2 r0 LOSS 2.0"]
    html = client.get(f"/jobs/{job.pk}/log-tail/", {"q": "loss", "rank": 0}).content.decode()
    assert _texts(html) == ["a1 r0 Loss 3.0", "a2 r0 LOSS 2.0"]  # any case
    assert 'value="loss"' in html and '<option value="0" selected>' in html
    # The poll carries the filters, so only the lines they keep are appended.
    poll = re.search(r'id="log-poll"[^>]* hx-get="([^"]+)"', html).group(1).replace("&amp;", "&")
    assert "q=loss" in poll and "rank=0" in poll
    # Its new lines go to the view of these filters alone: one asked under other filters,
    # answered after the reader changed them, finds no view to add to.
    view = re.search(r'data-view="(v[0-9a-f]+)"', html).group(1)
    polled = client.get(poll).content.decode()
    assert f"#log-lines[data-view={view}]" in polled or "hx-swap-oob" not in polled
    other = client.get(f"/jobs/{job.pk}/log-tail/", {"q": "loss", "rank": 1}).content.decode()
    assert re.search(r'data-view="(v[0-9a-f]+)"', other).group(1) != view
    new = _lines(Run.objects.get(job=job, attempt=2), ["a2 r0 loss 1.9"], first_seq=9)
    polled = client.get(poll).content.decode()
    assert f"#log-lines[data-view={view}]" in polled and _texts(polled) == ["a2 r0 loss 1.9"]
    assert f"after={new[0].pk}" in polled
    html = client.get(f"/jobs/{job.pk}/log-tail/", {"rank": "x", "attempt": "-1"}).content
    assert len(_texts(html.decode())) == 7  # a filter that is no number filters nothing


def test_the_poll_appends_only_the_new_lines_and_stops_after_the_end(
    client, fleet_pool, quota, team, researcher, django_assert_max_num_queries
):
    job = submit(team, researcher)
    run = _run(job)
    first = _lines(run, [f"line {i}" for i in range(3)])
    logged_in(client, researcher)
    with django_assert_max_num_queries(7):
        html = client.get(f"/jobs/{job.pk}/log-tail/", {"after": first[-1].pk}).content.decode()
    assert "hx-swap-oob" not in html and _texts(html) == []  # nothing new: the poll alone
    assert f"after={first[-1].pk}" in html and "data-live" in html

    new = _lines(run, ["line 3", "line 4"], first_seq=3)
    html = client.get(f"/jobs/{job.pk}/log-tail/", {"after": first[-1].pk}).content.decode()
    assert re.search(r'hx-swap-oob="beforeend:#log-lines\[data-view=v[0-9a-f]{12}\]"', html)
    assert _texts(html) == ["line 3", "line 4"]
    assert f"after={new[-1].pk}" in html  # the next poll asks after the newest

    # More than a poll shows: the newest, and a mark that some were left out.
    _lines(run, [f"burst {i}" for i in range(250)], first_seq=10)
    html = client.get(f"/jobs/{job.pk}/log-tail/", {"after": new[-1].pk}).content.decode()
    assert "log-gap" in html and _texts(html)[-1] == "burst 249" and len(_texts(html)) == 200

    # Finished a moment ago: it still asks (late lines come apart from the exit); later, not.
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    assert "data-live" in client.get(f"/jobs/{job.pk}/log-tail/", {"after": 0}).content.decode()
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - dt.timedelta(minutes=1))
    html = client.get(f"/jobs/{job.pk}/log-tail/", {"after": 0}).content.decode()
    assert "data-live" not in html


# --- the download ------------------------------------------------------------------------------


def test_the_download_streams_every_stored_line_in_order(
    client, fleet_pool, quota, team, researcher, django_assert_max_num_queries
):
    job = submit(team, researcher)
    run = _run(job)
    _lines(run, [f"line {i}" for i in range(12_001)])
    _lines(_run(job, attempt=2), ["again"])
    logged_in(client, researcher)
    response = client.get(f"/jobs/{job.pk}/log.txt")
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="job-{job.pk}.log"'
    with django_assert_max_num_queries(5):  # three reads of 5,000 lines, one of none left
        text = b"".join(response.streaming_content).decode()
    lines = text.splitlines()
    assert len(lines) == 12_002
    assert lines[0].endswith("[attempt 1 rank 0] line 0")
    assert lines[12_000].endswith("[attempt 1 rank 0] line 12000")
    assert lines[-1].endswith("[attempt 2 rank 0] again")
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z \[", lines[0])


def test_the_download_is_for_the_jobs_team_only(
    client,
    fleet_pool,
    quota,
    team,
    researcher,
    viewer,
    ops_user,
    other_member,
):
    job = submit(team, researcher)
    _lines(_run(job), ["team secret"])
    assert client.get(f"/jobs/{job.pk}/log.txt").status_code == 302  # to the login
    logged_in(client, other_member)
    response = client.get(f"/jobs/{job.pk}/log.txt")
    assert response.status_code == 404 and b"team secret" not in response.content
    logged_in(client, viewer)  # a viewer of the team reads its jobs' output
    response = client.get(f"/jobs/{job.pk}/log.txt")
    assert b"team secret" in b"".join(response.streaming_content)
    logged_in(client, ops_user)
    assert client.get(f"/jobs/{job.pk}/log.txt").status_code == 200


# --- jobs compared ----------------------------------------------------------------------------


def _steps(job: Job, losses: list[float], *, attempt: int = 1, first: int = 1) -> None:
    now = timezone.now()
    StepMetric.objects.bulk_create(
        StepMetric(
            job=job,
            attempt=attempt,
            step=first + i,
            at=now,
            loss=loss,
            tokens_per_s=1000.0 + i,
        )
        for i, loss in enumerate(losses)
    )


def test_compare_overlays_the_jobs_curves_with_a_bounded_number_of_queries(
    client, fleet_pool, quota, team, researcher, other_member, django_assert_max_num_queries
):
    jobs = [submit(team, researcher, name=f"run-{i}") for i in range(3)]
    _steps(jobs[0], [5.0 - s / 1000 for s in range(1200)])  # thinned to 500 points or so
    _steps(jobs[1], [4.0, 3.0, 2.0])
    _steps(jobs[1], [2.5, 1.5], attempt=2, first=2)  # resumed: its newest attempt wins
    theirs = submit(other_member.memberships.first().team, other_member, name="theirs")
    _steps(theirs, [1.0, 0.5])
    logged_in(client, researcher)
    query = "&".join(f"job={j.pk}" for j in [*jobs, theirs])
    with django_assert_max_num_queries(8):  # two of them for the curves, whatever the jobs
        html = client.get(f"/jobs/compare/?{query}").content.decode()
    assert re.findall(r'<tr data-job="(\d+)"', html) == [str(j.pk) for j in jobs]
    assert "theirs" not in html and "1 of the jobs asked for is not one you can see" in html
    assert html.count("<polyline") == 4  # loss and tokens/s of the two jobs with steps
    assert html.count('class="swatch"') == 3
    row = re.search(rf'<tr data-job="{jobs[1].pk}">(.*?)</tr>', html, re.S).group(1)
    assert ">1.5000<" in row and ">3<" in row  # last loss, from attempt 2; steps
    loss_chart = re.search(r'aria-label="Loss".*?</svg>', html, re.S).group(0)
    first = re.search(r'<polyline[^>]*points="([^"]+)"', loss_chart).group(1)
    assert 400 <= len(first.split()) <= 500
    assert "no steps" not in html and "none reported" in html  # run-2 reported none


def test_compare_takes_at_most_six_jobs_and_says_so(client, fleet_pool, quota, team, researcher):
    jobs = [submit(team, researcher, name=f"many-{i}") for i in range(8)]
    logged_in(client, researcher)
    html = client.get("/jobs/compare/", {"job": [j.pk for j in jobs]}).content.decode()
    assert html.count("<tr data-job=") == 6 and "At most 6 jobs" in html


def test_the_history_lets_jobs_be_ticked_for_compare(client, fleet_pool, quota, team, researcher):
    job = submit(team, researcher)
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    html = logged_in(client, researcher).get("/jobs/history/").content.decode()
    assert re.search(r'<form method="get" action="/jobs/compare/" id="compare-form">', html)
    assert f'<input type="checkbox" name="job" value="{job.pk}"' in html
    assert "overlaid (up to 6)" in html


# --- ranks, counted in processes -----------------------------------------------------------


def _to_success(job: Job) -> tuple[str, str]:
    """Dispatched, every run started then exited 0: the job's reasons when it started and
    when it ended."""
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    runs = list(Run.objects.filter(job=job))
    for run in runs:
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})
    started = Job.objects.get(pk=job.pk).state_reason
    for run in runs:
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "exited", "exit_code": 0})
    job = Job.objects.get(pk=job.pk)
    assert job.state == JobState.SUCCEEDED
    return started, job.state_reason


def test_an_8_gpu_trainer_on_one_node_counts_8_ranks(fleet_pool, quota, team, researcher):
    spec = trainer_spec(team, preset="tiny", nodes=1, layout={"dp_shard": 8}, seq_len=256)
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    started, ended = _to_success(job)
    assert started == "all 8 ranks (1 node × 8 processes) started"
    assert ended == "all 8 ranks (1 node × 8 processes) exited 0"


def test_a_two_node_trainer_counts_16_ranks_and_a_command_job_its_nodes(
    fleet_pool, quota, team, researcher
):
    spec = trainer_spec(team, preset="tiny", nodes=2, layout={"dp_shard": 16}, seq_len=256)
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    assert _to_success(job)[1] == "all 16 ranks (2 nodes × 8 processes) exited 0"
    spec = command_spec(team, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    assert _to_success(job) == (
        "the command started on all 2 nodes",
        "the command exited 0 on all 2 nodes",
    )
