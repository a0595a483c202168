"""Tuning runs and profile versions over the REST API, with real tokens: ops start, adopt,
decline and cancel runs; everyone reads a run, its progress and its figures (JSON and CSV);
ops restore a profile's earlier version. The runs are measured without a GPU, as
tests/apps/tuning/test_runs.py does."""

import csv
import datetime as dt
import io
import statistics

import pytest
from django.utils import timezone

from apps.jobs.models import Job, JobState
from apps.tuning import runs
from apps.tuning.models import NcclProfile, TuningMeasurement, TuningRun, TuningRunState
from apps.tuning.services import nccl_profile_update
from tests.apps.tuning.test_runs import SIZES, collective, measured, report, start

pytestmark = pytest.mark.django_db
S = TuningRunState
RUNS = "/api/v1/tuning-runs/"


def body(where, owner, **plan):
    """A start request on pool `where`, counted to team `owner`; `plan` overrides any field."""
    return {
        "pool": where.slug,
        "team": owner.slug,
        "sizes": SIZES,
        "sizes_that_matter": [2**20, 2**24],
        "ops": ["all_gather", "reduce_scatter"],
        "limit": 3,
        **plan,
    }


def test_ops_start_a_run_and_get_it_back_with_its_job(ib_pool, ops_user, team, api_for):
    api = api_for(ops_user, scopes=("admin",))
    answer = api.post(
        RUNS,
        body(ib_pool, team, rounds=6, candidates=[{"NCCL_MIN_NCHANNELS": "4"}], priority="high"),
        format="json",
    )
    assert answer.status_code == 201, answer.content
    data = answer.json()
    run = TuningRun.objects.get()
    job = Job.objects.get()
    assert (data["id"], data["job"], data["state"], data["pool"]) == (
        run.pk,
        job.pk,
        "queued",
        ib_pool.slug,
    )
    assert job.state == JobState.PENDING and job.priority_class == "high"
    assert sorted(data["nodes"]) == sorted(run.node_names) and len(data["nodes"]) == 4
    assert data["candidates"][0] == {
        "index": 0,
        "label": "baseline",
        "changes": {},
        "origin": "baseline",
    }
    mine = [c for c in data["candidates"] if c["origin"] == "ops"]
    assert [c["changes"] for c in mine] == [{"NCCL_MIN_NCHANNELS": "4"}]
    assert data["progress"] == {
        "done": 0,
        "total": 6 * len(run.candidates),
        "percent": 0.0,
        "eta_s": None,
    }
    assert data["result"] is None and data["adopted_version"] is None
    assert [e["to_state"] for e in data["events"]] == ["queued"]


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        ({"rounds": 4}, "rounds"),
        ({"candidates": [{"NCCL_ALGO": "Bogus"}]}, "candidates.NCCL_ALGO"),
        ({"ops": ["broadcast"]}, "ops"),
        ({"sizes": [1000]}, "sizes"),
        ({"nodes": ["no-such-node"]}, "nodes"),
        ({"pool": "no-such-pool"}, "pool"),
        ({"team": "no-such-team"}, "team"),
        ({"priority": "whenever"}, "priority"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_a_bad_start_is_a_400_naming_the_field_and_writes_nothing(
    ib_pool, ops_user, team, api_for, plan, field
):
    answer = api_for(ops_user).post(RUNS, body(ib_pool, team, **plan), format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.json()["error"]["details"], answer.json()
    assert not TuningRun.objects.exists() and not Job.objects.exists()


@pytest.mark.parametrize(("who", "scopes"), [("researcher", ("admin",)), ("ops", ("submit",))])
def test_only_ops_with_an_admin_token_start_runs(
    ib_pool, ops_user, researcher, team, api_for, who, scopes
):
    user = ops_user if who == "ops" else researcher
    answer = api_for(user, scopes=scopes).post(RUNS, body(ib_pool, team), format="json")
    assert answer.status_code == 403, answer.content
    assert set(answer.json()["error"]) == {"code", "message", "details"}
    assert not TuningRun.objects.exists() and not Job.objects.exists()


def test_progress_counts_launches_and_the_time_left_at_the_pace_so_far(
    ib_pool, ops_user, team, viewer, api_for
):
    run = start(ib_pool, ops_user, team, rounds=10)  # 4 settings × 10 rounds = 40 launches
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="running")
    runs.tuning_events_record(
        job_id=run.job_id, events=[{"event": "tuning_launch", "done": 12}], head=True
    )
    TuningRun.objects.filter(pk=run.pk).update(started_at=timezone.now() - dt.timedelta(minutes=2))
    data = api_for(viewer, scopes=("read",)).get(f"{RUNS}{run.pk}/").json()
    progress = data["progress"]
    assert (progress["done"], progress["total"], progress["percent"]) == (12, 40, 30.0)
    assert 280 <= progress["eta_s"] <= 282  # 120 s for 12 launches: 28 more take 280 s
    assert data["state"] == "running" and data["started_at"] is not None


def test_figures_give_each_rounds_value_and_their_median(ib_pool, ops_user, team, viewer, api_for):
    run = start(ib_pool, ops_user, team, rounds=5)
    ring = [10.0, 50.0, 20.0, 40.0, 30.0]  # median 30
    gaps = {0: 1.0, 1: 2.0, 3: 3.0, 4: 4.0}  # round 2 missing: median of four, 2.5
    events = [collective(1, r, "all_gather", 2**20, v) for r, v in enumerate(ring)]
    events += [collective(0, r, "reduce_scatter", 2**10, v) for r, v in gaps.items()]
    assert runs.tuning_events_record(job_id=run.job_id, events=events, head=True) == 9
    api = api_for(viewer, scopes=("read",))

    data = api.get(f"{RUNS}{run.pk}/figures/").json()
    assert (data["run"], data["rounds"]) == (run.pk, 5)
    baseline, candidate = data["figures"]  # the baseline first
    assert baseline == {
        "candidate": 0,
        "label": "baseline",
        "baseline": True,
        "op": "reduce_scatter",
        "bytes": 2**10,
        "median_busbw_gbps": 2.5,
        "busbw_gbps": [1.0, 2.0, None, 3.0, 4.0],
    }
    assert candidate["busbw_gbps"] == ring and candidate["median_busbw_gbps"] == 30.0
    assert candidate["median_busbw_gbps"] == statistics.median(ring)
    assert candidate["label"] == run.candidates[1]["label"] and not candidate["baseline"]

    answer = api.get(f"{RUNS}{run.pk}/figures/", {"format": "csv"})
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert len(rows) == TuningMeasurement.objects.filter(run=run).count() == 9
    assert [float(r["busbw_gbps"]) for r in rows if r["candidate"] == "1"] == ring
    assert {r["label"] for r in rows} == {"baseline", run.candidates[1]["label"]}
    assert rows[0].keys() >= {"round", "op", "bytes", "algbw_gbps", "time_us", "errors"}


def test_ops_adopt_what_the_rule_chose_and_a_second_adoption_is_a_409(
    ib_pool, ops_user, researcher, team, api_for
):
    run = start(ib_pool, ops_user, team, rounds=6)
    report(run, {2: 1.25})
    run = measured(run)
    assert run.state == S.AWAITING_APPROVAL
    detail = api_for(researcher, scopes=("read",)).get(f"{RUNS}{run.pk}/").json()
    chosen = run.candidates[2]["label"]
    assert detail["result"]["chosen"] == 2 and detail["result"]["verdicts"][chosen]["adopt"]

    refused = api_for(researcher).post(f"{RUNS}{run.pk}/adopt/")
    assert refused.status_code == 403
    ops = api_for(ops_user)
    answer = ops.post(f"{RUNS}{run.pk}/adopt/")
    assert answer.status_code == 200, answer.content
    tuned = NcclProfile.objects.get(pool=ib_pool)
    data = answer.json()
    assert data["state"] == "adopted" and data["decided_by"] == ops_user.username
    assert data["adopted_version"] == {"profile": tuned.name, "number": 1}
    for path in ("adopt", "decline", "cancel"):
        again = ops.post(f"{RUNS}{run.pk}/{path}/", {}, format="json")
        assert again.status_code == 409, (path, again.content)

    versions = ops.get(f"/api/v1/nccl-profiles/{tuned.name}/versions/").json()["results"]
    assert [(v["number"], v["source"], v["tuning_run"]) for v in versions] == [
        (1, "adopted", run.pk)
    ]
    assert versions[0]["made_by"] == ops_user.username and versions[0]["env"] == tuned.env


def test_ops_decline_with_a_reason_and_the_baseline_stays(ib_pool, ops_user, team, api_for):
    run = start(ib_pool, ops_user, team)
    report(run, {3: 1.3})
    run = measured(run)
    answer = api_for(ops_user).post(
        f"{RUNS}{run.pk}/decline/", {"reason": "not in a change window"}, format="json"
    )
    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "declined"
    assert "not in a change window" in answer.json()["reason"]
    assert not NcclProfile.objects.filter(pool=ib_pool).exists()


def test_ops_cancel_a_queued_run_through_its_job_and_again_is_a_409(
    ib_pool, ops_user, team, api_for
):
    run = start(ib_pool, ops_user, team)
    api = api_for(ops_user)
    assert api.post(f"{RUNS}{run.pk}/adopt/").status_code == 409  # nothing awaits approval
    answer = api.post(f"{RUNS}{run.pk}/cancel/")
    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "cancelled"
    assert Job.objects.get(pk=run.job_id).state == JobState.CANCELLED
    assert api.post(f"{RUNS}{run.pk}/cancel/").status_code == 409


def test_the_list_filters_by_pool_state_and_kind_and_exports_csv(
    ib_pool, efa_pool, ops_user, team, viewer, api_for
):
    first = start(ib_pool, ops_user, team)
    second = start(ib_pool, ops_user, team)
    runs.tuning_runs_follow_jobs(job_ids=[second.job_id], to="running")
    api = api_for(viewer, scopes=("read",))

    def ids(**query):
        answer = api.get(RUNS, query)
        assert answer.status_code == 200, answer.content
        return [row["id"] for row in answer.json()["results"]]

    assert ids() == [second.pk, first.pk]  # newest first
    assert ids(state="queued") == [first.pk]
    assert ids(pool=ib_pool.slug, state="running") == [second.pk]
    assert ids(pool=efa_pool.slug) == [] and ids(kind="drift") == []
    assert api.get(RUNS, {"page_size": 1}).json()["count"] == 2

    answer = api.get(RUNS, {"format": "csv", "state": "running"})
    assert answer["Content-Type"].startswith("text/csv")
    (row,) = list(csv.DictReader(io.StringIO(answer.content.decode())))
    assert (row["id"], row["pool"], row["state"]) == (str(second.pk), ib_pool.slug, "running")
    assert (row["done"], row["total"]) == ("0", str(second.launches_total))
    bad = api.get(RUNS, {"format": "csv", "state": "sleeping"})
    assert bad.status_code == 400 and "state" in bad.json()["error"]["details"]


def test_a_profiles_versions_and_ops_restore_an_earlier_one(ops_user, researcher, api_for):
    profile = NcclProfile.objects.get(name="efa-p5")
    first = dict(profile.env)
    nccl_profile_update(profile=profile, by=ops_user, env={**first, "NCCL_DEBUG": "INFO"})
    versions = f"/api/v1/nccl-profiles/{profile.name}/versions/"
    listed = api_for(researcher, scopes=("read",)).get(versions).json()["results"]
    assert [(v["number"], v["source"], v["current"]) for v in listed] == [
        (2, "edited", True),
        (1, "created", False),
    ]
    assert listed[1]["env"] == first and listed[0]["made_by"] == ops_user.username

    assert api_for(researcher).post(f"{versions}1/restore/").status_code == 403
    ops = api_for(ops_user)
    answer = ops.post(f"{versions}1/restore/")
    assert answer.status_code == 200, answer.content
    assert answer.json()["env"] == first and answer.json()["version"] == 3
    latest = ops.get(versions).json()["results"][0]
    assert (latest["number"], latest["source"], latest["note"]) == (
        3,
        "restored",
        "version 1 restored",
    )
    assert ops.post(f"{versions}3/restore/").status_code == 409  # the current one
    assert ops.post(f"{versions}99/restore/").status_code == 404
    assert ops.get("/api/v1/nccl-profiles/no-such-profile/versions/").status_code == 404
