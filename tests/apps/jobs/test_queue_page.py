"""The Queue page's estimated starts, nodes and elapsed time, its CSV and its live region; the
History's nodes."""

import csv
import datetime as dt
import io
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts import services as accounts
from apps.jobs import services
from apps.jobs.dispatch import job_dispatch, run_report
from apps.jobs.models import Job, JobState, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db

HOUR = 3600


def submit(team, user, **overrides) -> Job:
    job, _ = services.job_submit(team=team, spec=command_spec(team, **overrides), submitted_by=user)
    return job


def start(job: Job) -> Run:
    """Dispatch the admitted job and report its run started, as its agent would."""
    job_dispatch(job_id=job.pk)
    run = Run.objects.filter(job=job).order_by("-attempt").first()
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 4242})
    return run


@pytest.fixture
def full_fleet(fleet_pool, team, researcher):
    """The four 8-GPU nodes held by four 1-hour jobs (one of them running), then two jobs
    waiting behind them: one the pass has seen, one submitted since."""
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    holding = [submit(team, researcher, name=f"holder-{n}") for n in range(4)]
    scheduling_pass()
    run = start(holding[0])
    seen = submit(team, researcher, name="seen-by-a-pass", time_limit_s=2 * HOUR)
    scheduling_pass()
    unseen = submit(team, researcher, name="not-yet-seen", time_limit_s=2 * HOUR)
    return {"running": holding[0], "node": run.node, "seen": seen, "unseen": unseen}


def row_html(html: str, job_id: int) -> str:
    match = re.search(rf'<tr data-job="{job_id}".*?</tr>', html, re.S)
    assert match, f"no row for job {job_id}"
    return match.group(0)


def estimate_in(row: str) -> tuple[dt.datetime, str]:
    cell = re.search(r'<td class="nowrap estimate">(.*?)</td>', row, re.S).group(1)
    match = re.search(r'<time datetime="([^"]+)" title="([^"]+)"', cell)
    assert match, f"no estimate in {cell!r}"
    return dt.datetime.fromisoformat(match.group(1)), match.group(2)


def test_pending_jobs_get_a_start_from_the_running_jobs_time_limits(client, full_fleet, researcher):
    in_an_hour = timezone.now() + dt.timedelta(hours=1)

    html = client.force_login(researcher) or client.get("/jobs/").content.decode()

    for job in (full_fleet["seen"], full_fleet["unseen"]):
        start, basis = estimate_in(row_html(html, job.pk))
        assert abs((start - in_an_hour).total_seconds()) < 120
        assert "time limit" in basis
    # Nothing is estimated for a job that holds its GPUs.
    assert "<time" not in re.search(
        r'<td class="nowrap estimate">(.*?)</td>', row_html(html, full_fleet["running"].pk), re.S
    ).group(1)


def test_a_job_no_node_set_can_hold_says_why_it_has_no_estimate(client, full_fleet, researcher):
    # 40 GPUs on a fleet of 32: submitted before the pools were narrowed, it can never start.
    Job.objects.filter(pk=full_fleet["unseen"].pk).update(nodes=5)
    client.force_login(researcher)

    row = row_html(client.get("/jobs/").content.decode(), full_fleet["unseen"].pk)

    assert re.search(r'<span class="muted" title="No start can be estimated: [^"]*40 H100', row)


def test_the_queue_shows_the_nodes_a_job_holds_and_how_long_it_has_run(
    client, full_fleet, researcher
):
    Job.objects.filter(pk=full_fleet["running"].pk).update(
        started_at=timezone.now() - dt.timedelta(minutes=90)
    )
    client.force_login(researcher)

    html = client.get("/jobs/").content.decode()

    assert "<th>Nodes</th>" in html and '<th class="num">Elapsed</th>' in html
    running = row_html(html, full_fleet["running"].pk)
    assert f'<td class="nodes">{full_fleet["node"].name}</td>' in running
    elapsed = re.search(r'<td class="num nowrap elapsed">(.*?)</td>', running, re.S).group(1)
    assert "1\xa0hour, 30\xa0minutes" in elapsed
    pending = row_html(html, full_fleet["seen"].pk)
    assert '<td class="nodes"></td>' in pending


def test_the_queue_csv_has_the_nodes_elapsed_time_and_estimated_start(
    client, full_fleet, researcher
):
    client.force_login(researcher)

    rows = list(csv.DictReader(io.StringIO(client.get("/jobs/queue.csv").content.decode())))

    by_id = {int(row["id"]): row for row in rows}
    running = by_id[full_fleet["running"].pk]
    assert running["nodes"] == full_fleet["node"].name
    assert running["started_at"] and 0 <= int(running["elapsed_s"]) < 60
    assert running["estimated_start"] == ""
    for job in (full_fleet["seen"], full_fleet["unseen"]):
        row = by_id[job.pk]
        assert row["nodes"] == "" and row["elapsed_s"] == ""
        start = dt.datetime.fromisoformat(row["estimated_start"])
        assert start > timezone.now() + dt.timedelta(minutes=55)
    # A filtered export still counts the jobs ahead that the filter leaves out.
    filtered = list(
        csv.DictReader(
            io.StringIO(client.get("/jobs/queue.csv", {"state": "pending"}).content.decode())
        )
    )
    assert {int(r["id"]): r["estimated_start"] for r in filtered} == {
        job.pk: by_id[job.pk]["estimated_start"]
        for job in (full_fleet["seen"], full_fleet["unseen"])
    }


def test_the_live_region_keeps_the_filters_and_page_and_follows_a_state_change(
    client, full_fleet, researcher
):
    client.force_login(researcher)
    page = client.get("/jobs/", {"state": "pending"}).content.decode()
    assert (
        '<div id="queue-live" data-live hx-get="/jobs/queue/live/?state=pending" '
        'hx-trigger="every 5s, live:resume" hx-swap="outerHTML">' in page
    )

    services.job_cancel(job=full_fleet["seen"], by=researcher)
    live = client.get("/jobs/queue/live/", {"state": "pending", "page": "1"})

    assert live.status_code == 200
    html = live.content.decode()
    assert html.lstrip().startswith('<div id="queue-live"')
    assert 'hx-get="/jobs/queue/live/?state=pending&amp;page=1"' in html
    assert f'<tr data-job="{full_fleet["seen"].pk}"' not in html
    assert f'<tr data-job="{full_fleet["unseen"].pk}"' in html
    assert '<p class="muted" id="queue-count" hx-swap-oob="true">1 active job matches' in html
    # A Cancel inside the region comes back to the page, not to the fragment.
    assert 'name="next" value="/jobs/?state=pending&amp;page=1"' in html
    assert "<html" not in html


# session, user, the active jobs' ids, roles, the page's rows, the pending jobs since the
# last pass (only when the page has one), the rows of the jobs ahead, GPUs per type and
# when held ones come back (once per pass when the cache has the pass), the nodes held,
# teams by slug, the budget banner; and the page's filter choices.
LIVE_QUERIES = 12
PAGE_QUERIES = LIVE_QUERIES + 1


@pytest.mark.parametrize(
    ("path", "queries"),
    [
        ("/jobs/", PAGE_QUERIES),
        ("/jobs/queue/live/", LIVE_QUERIES),
        ("/jobs/queue/live/?team=alpha", LIVE_QUERIES),
        ("/jobs/queue/live/?state=pending&page=1", LIVE_QUERIES),
    ],
)
@pytest.mark.parametrize("pending", [2, 20])
def test_the_queue_and_its_live_region_make_a_bounded_number_of_queries(
    client, django_assert_max_num_queries, full_fleet, team, researcher, path, queries, pending
):
    for n in range(pending):
        submit(team, researcher, name=f"more-{n}")
    client.force_login(researcher)

    with django_assert_max_num_queries(queries):
        html = client.get(path).content.decode()

    assert html.count('<td class="nowrap estimate"><time') == 2 + pending
    assert html.count("<tr data-job=") == (2 + pending if "pending" in path else 6 + pending)


def test_the_history_and_its_csv_say_which_nodes_a_finished_job_ran_on(
    client, full_fleet, researcher, django_assert_max_num_queries
):
    done = full_fleet["running"]
    now = timezone.now()
    Job.objects.filter(pk=done.pk).update(
        state=JobState.SUCCEEDED, started_at=now - dt.timedelta(minutes=5), finished_at=now
    )
    client.force_login(researcher)
    client.get("/jobs/history/")  # warm the session and roles

    with django_assert_max_num_queries(9):
        html = client.get("/jobs/history/").content.decode()

    assert "<th>Nodes</th>" in html
    assert f'<td class="nodes">{full_fleet["node"].name}</td>' in row_html(html, done.pk)
    rows = list(csv.DictReader(io.StringIO(client.get("/jobs/history.csv").content.decode())))
    assert [(int(r["id"]), r["nodes"], r["ran_s"]) for r in rows] == [
        (done.pk, full_fleet["node"].name, "300")
    ]


def test_the_gpu_supply_is_read_once_per_scheduling_pass(
    client, full_fleet, researcher, django_capture_on_commit_callbacks
):
    def queries_and_estimates() -> tuple[int, list[str]]:
        with CaptureQueriesContext(connection) as counted:
            html = client.get("/jobs/queue/live/").content.decode()
        return len(counted), re.findall(
            r'<td class="nowrap estimate"><time datetime="([^"]+)"', html
        )

    with django_capture_on_commit_callbacks(execute=True):
        scheduling_pass()  # publishes when it read: the supply's key
    client.force_login(researcher)

    first, estimates = queries_and_estimates()
    again, same = queries_and_estimates()
    assert again == first - 2 and same == estimates and len(estimates) == 2
    with django_capture_on_commit_callbacks(execute=True):
        scheduling_pass()
    assert queries_and_estimates()[0] == first


def test_the_queue_api_gives_the_same_estimates_nodes_and_start_as_the_page(
    client, full_fleet, researcher
):
    client.force_login(researcher)
    page = {
        int(r["id"]): r
        for r in csv.DictReader(io.StringIO(client.get("/jobs/queue.csv").content.decode()))
    }

    rows = client.get("/api/v1/queue/").json()["results"]

    by_id = {row["id"]: row for row in rows}
    running = by_id[full_fleet["running"].pk]
    assert running["nodes"] == [full_fleet["node"].name] and running["started_at"]
    for job in (full_fleet["seen"], full_fleet["unseen"]):
        row = by_id[job.pk]
        assert row["estimate_basis"] and row["nodes"] == [] and row["started_at"] is None
        assert dt.datetime.fromisoformat(row["estimated_start"]) == dt.datetime.fromisoformat(
            page[job.pk]["estimated_start"]
        )
