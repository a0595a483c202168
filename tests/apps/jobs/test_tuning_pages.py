"""The NCCL tuning runs' pages through the Django test client: the list (with its CSV and the
form ops start a run from), a run's page (progress, candidates, verdicts and the charts' data),
Adopt / Decline / Cancel, and a profile's versions with Restore. Runs are measured without a
GPU by the helpers of tests/apps/tuning/test_runs.py."""

import csv
import io
import re
import statistics

import pytest

from apps.tuning import runs
from apps.tuning.models import (
    NcclProfile,
    NcclProfileVersion,
    TuningRun,
    TuningRunState,
    VersionSource,
)
from apps.tuning.services import nccl_profile_update
from tests import factories
from tests.apps.tuning.conftest import ib_pool  # noqa: F401 (a fixture)
from tests.apps.tuning.test_runs import measured, report, start

pytestmark = pytest.mark.django_db
S = TuningRunState


@pytest.fixture
def pool(ib_pool):  # noqa: F811 (the fixture imported above)
    """tests/apps/tuning's InfiniBand pool of four 8-GPU nodes."""
    return ib_pool


def logged_in(client, user):
    client.force_login(user)
    return client


def form(node_pool, team, **changes) -> dict:
    data = {
        "pool": node_pool.slug,
        "nodes": "",
        "rounds": "5",
        "limit": "3",
        "candidates": "NCCL_ALGO=Ring, NCCL_PROTO=Simple\n",
        "approval_required": "on",
        "team": team.slug,
    }
    data.update(changes)
    return data


# --- the list and the start form ----------------------------------------------------------------


def test_the_list_shows_runs_and_exports_them_and_only_ops_get_the_form(
    client, pool, ops_user, viewer, team
):
    run = start(pool, ops_user, team)
    html = logged_in(client, viewer).get("/nccl/tuning/").content.decode()
    assert "<h1>NCCL tuning runs</h1>" in html
    assert re.findall(r'<tr data-run="(\d+)" data-state="(\w+)"', html) == [(str(run.pk), "queued")]
    assert "0 / 20" in html and ops_user.get_username() in html
    assert 'id="tuning-start"' not in html
    assert '<a href="/nccl/tuning/" class="active" aria-current="page">NCCL tuning</a>' in html

    page = logged_in(client, ops_user).get("/nccl/tuning/").content.decode()
    assert 'id="tuning-start"' in page and f'<option value="{pool.slug}"' in page

    rows = list(
        csv.reader(
            io.StringIO(client.get("/nccl/tuning/runs.csv", {"pool": "ib-h100"}).content.decode())
        )
    )
    assert rows[0][:4] == ["id", "kind", "pool", "state"]
    assert [row[:4] for row in rows[1:]] == [[str(run.pk), "tuning", "ib-h100", "queued"]]
    assert (
        client.get("/nccl/tuning/runs.csv", {"pool": "elsewhere"}).content.decode().count("\n") == 1
    )


def test_ops_start_a_run_from_the_form_with_their_own_candidate(client, pool, ops_user, team):
    response = logged_in(client, ops_user).post("/nccl/tuning/", form(pool, team))
    run = TuningRun.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/nccl/tuning/{run.pk}/"
    assert run.candidates[1]["changes"] == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    assert run.candidates[1]["origin"] == "ops"
    assert (run.rounds, len(run.candidates), run.approval_required) == (5, 4, True)
    assert run.job.team == team and len(run.node_ids) == 4


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"rounds": "3"}, "rounds", "fewer cannot tell a change from the noise"),
        ({"candidates": "NCCL_ALGO\n"}, "candidates", "Line 1: NCCL_ALGO is not NAME=VALUE."),
        ({"candidates": "NCCL_ALGO=Bogus\n"}, "candidates", "NCCL_ALGO: "),
        ({"nodes": "nowhere-1"}, "nodes", "nowhere-1: no such node"),
        ({"pool": "nowhere"}, "pool", "Select a valid choice"),
    ],
)
def test_a_bad_form_is_a_400_naming_the_field_and_writes_nothing(
    client, pool, ops_user, team, changes, field, message
):
    response = logged_in(client, ops_user).post("/nccl/tuning/", form(pool, team, **changes))
    assert response.status_code == 400
    html = response.content.decode()
    assert "The tuning run was not started" in html
    assert response.context["form"].errors[field], response.context["form"].errors
    assert message in " ".join(response.context["form"].errors[field])
    assert not TuningRun.objects.exists()


def test_only_ops_start_runs(client, pool, researcher, team):
    response = logged_in(client, researcher).post("/nccl/tuning/", form(pool, team))
    assert response.status_code == 403 and not TuningRun.objects.exists()


# --- a run's page ------------------------------------------------------------------------------


def test_the_run_page_shows_progress_and_stays_live_while_it_runs(client, pool, ops_user, team):
    run = start(pool, ops_user, team, rounds=5)
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="running")
    runs.tuning_events_record(
        job_id=run.job_id, events=[{"event": "tuning_launch", "done": 8}], head=True
    )
    html = logged_in(client, ops_user).get(f"/nccl/tuning/{run.pk}/").content.decode()
    assert "<strong>8 of 20 launches</strong>" in html
    assert "4 settings: the baseline and 3 candidates, × 5 rounds" in html
    assert re.search(r"about \d+ min left", html)
    assert f'hx-get="/nccl/tuning/{run.pk}/live/"' in html
    assert f'href="/jobs/{run.job_id}/"' in html
    assert 'data-action="cancel"' in html and 'data-action="adopt"' not in html
    live = client.get(f"/nccl/tuning/{run.pk}/live/").content.decode()
    assert live.lstrip().startswith('<div id="run-live"') and "<html" not in live


def test_the_charts_draw_the_median_over_rounds_per_candidate_with_the_baseline_bold(
    client, pool, ops_user, team
):
    run = start(pool, ops_user, team, rounds=6)
    report(run, {2: 1.25})
    run = measured(run)
    assert run.state == S.AWAITING_APPROVAL
    response = logged_in(client, ops_user).get(f"/nccl/tuning/{run.pk}/")
    html = response.content.decode()
    drawn = {chart["op"]: chart for chart in response.context["charts"]}
    assert sorted(drawn) == ["all_gather", "reduce_scatter"]
    figures = runs.figures(run)
    label = run.candidates[2]["label"]
    points = drawn["all_gather"]["points"]
    assert set(points) == {c["label"] for c in run.candidates}
    assert points[label] == [
        (size, statistics.median(figures[2]["all_gather"][size])) for size in run.sizes
    ]
    assert html.count('class="series bold"') == 2  # the baseline, on each chart
    assert "<title>baseline</title>" in html
    # Not live any more (it awaits a click), and ops get the buttons.
    assert "data-live" not in html
    assert 'data-action="adopt"' in html and 'data-action="decline"' in html
    verdict = run.result["verdicts"][label]["summary"]
    assert verdict in html and "%" in verdict


def test_adopt_through_the_button_then_the_profile_page_shows_the_version(
    client, pool, ops_user, viewer, team
):
    run = start(pool, ops_user, team, rounds=6)
    report(run, {2: 1.25})
    run = measured(run)
    assert logged_in(client, viewer).post(f"/nccl/tuning/{run.pk}/adopt/").status_code == 403
    assert "data-action" not in client.get(f"/nccl/tuning/{run.pk}/").content.decode()

    response = logged_in(client, ops_user).post(f"/nccl/tuning/{run.pk}/adopt/", follow=True)
    run.refresh_from_db()
    assert run.state == S.ADOPTED and run.decided_by == ops_user
    html = response.content.decode()
    tuned = NcclProfile.objects.get(pool=pool)
    assert f"Tuning run #{run.pk} adopted." in html
    assert f'Adopted as <a href="/nccl/profiles/{tuned.name}/">{tuned.name} v1</a>' in html
    assert re.search(r'<tr data-candidate="2" data-adopted>', html)

    profile = client.get(f"/nccl/profiles/{tuned.name}/").content.decode()
    row = re.search(r'<tr data-version="1" data-source="adopted">.*?</tr>', profile, re.S).group(0)
    assert f'href="/nccl/tuning/{run.pk}/"' in row and ops_user.get_username() in row
    assert f'href="/nccl/tuning/?pool={pool.slug}"' in profile


def test_decline_and_cancel_through_the_buttons(client, pool, ops_user, team):
    run = start(pool, ops_user, team, rounds=6)
    report(run, {1: 1.3})
    run = measured(run)
    client = logged_in(client, ops_user)
    client.post(f"/nccl/tuning/{run.pk}/decline/")
    run.refresh_from_db()
    assert run.state == S.DECLINED and not NcclProfile.objects.filter(pool=pool).exists()
    again = client.post(f"/nccl/tuning/{run.pk}/adopt/", follow=True).content.decode()
    assert "nothing awaits approval" in again

    other = start(pool, ops_user, team)
    client.post(f"/nccl/tuning/{other.pk}/cancel/")
    other.refresh_from_db()
    assert other.state == S.CANCELLED and other.job.state == "cancelled"


def test_ops_restore_an_earlier_profile_version_from_the_profile_page(client, ops_user, viewer):
    profile = NcclProfile.objects.get(name="efa-p5")
    first = dict(profile.env)
    nccl_profile_update(
        profile=profile, by=ops_user, env={**first, "NCCL_DEBUG": "INFO"}, reasons={}
    )
    url = "/nccl/profiles/efa-p5/"
    html = logged_in(client, viewer).get(url).content.decode()
    assert re.findall(r'<tr data-version="(\d+)"', html) == ["2", "1"]
    assert 'data-action="restore"' not in html
    assert client.post(f"{url}versions/1/restore/").status_code == 403

    html = logged_in(client, ops_user).get(url).content.decode()
    assert html.count('data-action="restore"') == 1  # the earlier version, not the current one
    response = client.post(f"{url}versions/1/restore/", follow=True)
    assert "Version 1 of efa-p5 restored as version 3." in response.content.decode()
    profile.refresh_from_db()
    assert profile.env == first and profile.version == 3
    latest = NcclProfileVersion.objects.get(profile=profile, number=3)
    assert (latest.source, latest.made_by) == (VersionSource.RESTORED, ops_user)
    assert client.post(f"{url}versions/9/restore/").status_code == 404


# --- queries -------------------------------------------------------------------------------


def _more_runs(where, team, count: int) -> None:
    """Runs started by different ops people, some measured and adopted or declined: what an
    N+1 on these pages (a run's pool, starter, profile, version) would pay for once each."""
    for n in range(count):
        ops = factories.make_org_user(role="ops")
        run = start(where, ops, team, rounds=5, seed=n)
        if n % 3 == 0:
            runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="cancelled")
        elif n % 3 == 1:
            report(run, {1: 1.3}, seed=n)
            runs.tuning_run_decline(run=measured(run), by=ops)


# The session, the user, their roles and the navigation's budget alerts, then the page's own:
# the list reads the runs (with pool, starter, profile and version) and, for ops' form, the
# pools and the teams; a run's page reads the run (with all it names), its figures and events.
@pytest.mark.parametrize(("which", "queries"), [("list", 6), ("run", 6)])
def test_the_tuning_pages_make_as_many_queries_for_1_run_as_for_7(
    client, pool, ops_user, team, which, queries, django_assert_max_num_queries
):
    run = start(pool, ops_user, team, rounds=5)
    report(run, {1: 1.3})
    run = measured(run)
    runs.tuning_run_adopt(run=run, by=ops_user)
    url = "/nccl/tuning/" if which == "list" else f"/nccl/tuning/{run.pk}/"
    logged_in(client, ops_user)

    def ask():
        answer = client.get(url)
        assert answer.status_code == 200
        return answer.content.decode()

    ask()  # warm
    with django_assert_max_num_queries(queries) as few:
        ask()
    _more_runs(pool, team, 6)
    with django_assert_max_num_queries(len(few.captured_queries)):
        html = ask()
    if which == "list":
        assert len(re.findall(r'<tr data-run="', html)) == 7
