"""Tuning runs, on the control plane's side: the plan (baseline, linted candidates, rounds in
a shuffled order), its job pinned to the nodes, what the job's first node reports (kept only
inside the plan), the adoption rule's verdict, ops' approval as a new version of the pool's
profile, restoring a version, and drift checks. The node side (workers/trainer/tuning.py)
and a whole run through a real agent are tested in tests/workers/trainer/test_tuning.py and
tests/e2e/test_tuning_run.py."""

import datetime as dt
import json
import random

import pytest
from django.utils import timezone

from apps.accounts.models import AuditEvent
from apps.fleet.fabric import node_fabric_degraded_clear
from apps.fleet.models import Node
from apps.fleet.services import node_drain, node_undrain
from apps.jobs import transitions
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, JobKind, JobState
from apps.jobs.models import Run as JobRun
from apps.jobs.scheduler.run import scheduling_pass
from apps.jobs.services import job_submit
from apps.jobs.tuning_runs import (
    drift_checks_start,
    drift_followup,
    repaired_nodes_check,
    tuning_plan_file,
    tuning_run_start,
)
from apps.tuning import runs
from apps.tuning.models import (
    BISECT_AGAINST_GOOD,
    BISECT_PAIRS,
    BISECT_REPAIRED,
    TUNING_FINISHED,
    NcclProfile,
    NcclProfileVersion,
    TuningMeasurement,
    TuningRun,
    TuningRunKind,
    TuningRunState,
    VersionSource,
)
from apps.tuning.selectors import pools_nccl, profiles_all
from apps.tuning.services import (
    nccl_environment_render,
    nccl_profile_update,
    nccl_profile_version_restore,
)
from controlplane.errors import ApplicationError
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db
S = TuningRunState
SIZES = [2**10, 2**16, 2**20, 2**24]


def start(pool, by, team, **plan):
    plan.setdefault("sizes", SIZES)
    plan.setdefault("sizes_that_matter", [2**20, 2**24])
    plan.setdefault("ops", ["all_gather", "reduce_scatter"])
    plan.setdefault("limit", 3)
    plan.setdefault("seed", 7)
    return tuning_run_start(pool=pool.slug, by=by, team=team.slug, **plan)


def collective(candidate: int, round_: int, op: str, size: int, busbw: float, errors=0) -> dict:
    """One figure as the benchmark prints it."""
    return {
        "event": "collective",
        "candidate": candidate,
        "round": round_,
        "op": op,
        "bytes": size,
        "busbw_gbps": busbw,
        "algbw_gbps": busbw / 2,
        "time_us": size / busbw / 1e3,
        "errors": errors,
    }


def report(run, speed: dict[int, float], *, noise=0.02, seed=0, errors=None, skip=()):
    """What the job's first node would print: every candidate, round, op and size, each
    candidate's bus bandwidth its `speed` × 100 GB/s (1.0 when not named), with noise;
    the launches in `skip` ((round, candidate)) print nothing."""
    rng = random.Random(seed)  # noqa: S311 (made-up figures)
    events = []
    done = 0
    for round_, order in enumerate(run.order):
        drift = rng.uniform(0.9, 1.1)  # the fabric's mood this round: hits all alike
        for candidate in order:
            if (round_, candidate) in skip:
                continue
            for op in run.ops:
                for size in run.sizes:
                    busbw = 100 * speed.get(candidate, 1.0) * drift * rng.gauss(1, noise)
                    events.append(
                        collective(
                            candidate, round_, op, size, busbw, (errors or {}).get(candidate, 0)
                        )
                    )
            done += 1
            events.append({"event": "tuning_launch", "done": done, "round": round_})
    return runs.tuning_events_record(job_id=run.job_id, events=events, head=True)


def measured(run) -> TuningRun:
    """The job ran and succeeded: the run follows, and the judge task's work is done here."""
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="running")
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="succeeded")
    run.refresh_from_db()
    assert run.state == S.JUDGING
    return runs.tuning_run_judge(run.pk)


def test_a_run_measures_the_pools_profile_against_linted_candidates_in_shuffled_rounds(
    ib_pool, ops_user, team
):
    run = start(ib_pool, ops_user, team, rounds=6)
    baseline = run.candidates[0]
    rendered = nccl_environment_render(
        nccl=None, nodes=4, pool=pools_nccl(pool_ids=[ib_pool.pk])[0], profiles=profiles_all()
    )
    assert baseline["label"] == "baseline" and baseline["env"] == rendered.env
    assert run.profile.name == "ib-nvswitch-8gpu" and run.baseline_version.number == 1
    assert len(run.candidates) == 4  # the limit of 3, and the baseline
    for candidate in run.candidates[1:]:
        assert candidate["env"] == {**baseline["env"], **candidate["changes"]}
    assert [sorted(order) for order in run.order] == [[0, 1, 2, 3]] * 6
    assert len({tuple(order) for order in run.order}) > 1  # shuffled per round

    job = run.job
    assert (job.kind, job.state, job.team, job.nodes, job.gpus_per_node) == (
        JobKind.TUNING,
        JobState.PENDING,
        team,
        4,
        8,
    )
    assert sorted(job.node_ids) == sorted(run.node_ids) and len(run.node_ids) == 4
    plan = json.loads(tuning_plan_file(job)["content"])
    assert plan["order"] == run.order and plan["sizes"] == SIZES
    assert plan["candidates"][2] == {"index": 2, "env": run.candidates[2]["env"]}
    assert AuditEvent.objects.filter(action="tuning_run.tuning").exists()


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        ({"rounds": 4}, "rounds"),
        ({"candidates": [{"NCCL_ALGO": "Bogus"}]}, "candidates.NCCL_ALGO"),
        ({"candidates": [{"FI_EFA_USE_DEVICE_RDMA": "1"}]}, "candidates.FI_EFA_USE_DEVICE_RDMA"),
        ({"sizes": [1000]}, "sizes"),
        ({"sizes_that_matter": [2**30]}, "sizes_that_matter"),
        ({"ops": ["broadcast"]}, "ops"),
        ({"nodes": ["no-such-node"]}, "nodes"),
    ],
)
def test_a_bad_plan_is_a_400_that_names_the_field_and_writes_nothing(
    ib_pool, ops_user, team, plan, field
):
    with pytest.raises(ApplicationError) as caught:
        start(ib_pool, ops_user, team, **plan)
    assert caught.value.status == 400 and field in caught.value.details, caught.value.details
    assert not TuningRun.objects.exists() and not Job.objects.exists()


def test_only_ops_start_tuning_runs(ib_pool, researcher, team):
    with pytest.raises(ApplicationError) as caught:
        start(ib_pool, researcher, team)
    assert caught.value.status == 403 and not TuningRun.objects.exists()


def test_what_the_job_prints_is_kept_only_inside_the_runs_plan(ib_pool, ops_user, team):
    run = start(ib_pool, ops_user, team)
    good = {
        "event": "collective",
        "candidate": 1,
        "round": 0,
        "op": "all_gather",
        "bytes": 2**20 - 64,  # rounded down to whole elements by the benchmark
        "busbw_gbps": 90.0,
        "algbw_gbps": 50.0,
        "time_us": 20.0,
        "errors": 0,
    }
    bad = [
        {**good, "candidate": 9},
        {**good, "round": 5},
        {**good, "op": "broadcast"},
        {**good, "bytes": 2**28},  # not a size the plan measures
        {**good, "bytes": True},
        {**good, "busbw_gbps": float("nan")},
        {**good, "busbw_gbps": -1},
        {**good, "errors": "0"},
        {"event": "tuning_launch", "done": 10**6},
    ]
    # The benchmark's rank 0 may run on any node of the job: its figure counts from there.
    assert runs.tuning_events_record(job_id=run.job_id, events=[good, *bad], head=False) == 1
    again = {**good, "busbw_gbps": 1.0}  # the same point reported again: the first counts
    assert runs.tuning_events_record(job_id=run.job_id, events=[again, *bad], head=True) == 1
    (figure,) = TuningMeasurement.objects.filter(run=run)
    assert (figure.candidate, figure.round, figure.op, figure.bytes) == (1, 0, "all_gather", 2**20)
    assert figure.busbw_gbps == 90.0
    run.refresh_from_db()
    assert run.launches_done == 0  # a count past the plan's total is not believed
    launch = {"event": "tuning_launch", "done": 3}
    runs.tuning_events_record(job_id=run.job_id, events=[launch], head=False)
    run.refresh_from_db()
    assert run.launches_done == 0  # only the first node's driver counts launches
    runs.tuning_events_record(job_id=run.job_id, events=[launch], head=True)
    run.refresh_from_db()
    assert run.launches_done == 3


def test_a_candidate_faster_beyond_the_noise_awaits_approval_then_becomes_the_pools_profile(
    ib_pool, ops_user, team
):
    run = start(ib_pool, ops_user, team, rounds=6)
    report(run, {2: 1.25})
    run = measured(run)
    assert run.state == S.AWAITING_APPROVAL, run.state_reason
    assert run.result["chosen"] == 2
    chosen = run.candidates[2]
    assert run.result["verdicts"][chosen["label"]]["adopt"] is True
    assert chosen["label"] in run.state_reason
    assert not NcclProfile.objects.filter(pool=ib_pool).exists()  # nothing until approved

    run = runs.tuning_run_adopt(run=run, by=ops_user)
    assert run.state == S.ADOPTED and run.decided_by == ops_user
    tuned = NcclProfile.objects.get(pool=ib_pool)
    assert tuned.env == chosen["env"] and tuned.version == 1
    version = run.adopted_version
    assert (version.profile, version.source, version.tuning_run, version.made_by) == (
        tuned,
        VersionSource.ADOPTED,
        run,
        ops_user,
    )
    # The pool's multi-node jobs get it; its single-node jobs keep theirs.
    pool = pools_nccl(pool_ids=[ib_pool.pk])[0]
    across = nccl_environment_render(nccl=None, nodes=2, pool=pool, profiles=profiles_all())
    alone = nccl_environment_render(nccl=None, nodes=1, pool=pool, profiles=profiles_all())
    assert (across.profile, across.version, across.ok) == (tuned.name, 1, True)
    for name, value in chosen["changes"].items():
        assert across.env[name] == value
    assert alone.profile == "single-node"
    with pytest.raises(ApplicationError) as caught:
        runs.tuning_run_adopt(run=run, by=ops_user)
    assert caught.value.status == 409


def test_candidates_from_the_same_distribution_adopt_nothing_and_say_so(ib_pool, ops_user, team):
    run = start(ib_pool, ops_user, team)
    report(run, {}, noise=0.05)
    run = measured(run)
    assert run.state == S.NOTHING_ADOPTED
    assert "nothing adopted, the baseline stays" in run.state_reason
    assert not NcclProfile.objects.filter(pool=ib_pool).exists()


def test_without_approval_the_rule_adopts_at_once(ib_pool, ops_user, team):
    run = start(ib_pool, ops_user, team, approval_required=False)
    report(run, {1: 1.3})
    run = measured(run)
    assert run.state == S.ADOPTED and run.decided_by is None
    assert "no approval asked" in run.state_reason


def test_a_candidate_that_gave_wrong_results_is_disqualified_however_fast(ib_pool, ops_user, team):
    run = start(ib_pool, ops_user, team)
    report(run, {1: 2.0}, errors={1: 3})
    run = measured(run)
    assert run.state == S.NOTHING_ADOPTED
    assert run.result["not_judged"][run.candidates[1]["label"]].startswith("gave wrong results")


def test_the_judge_waits_for_the_last_launchs_lines_then_judges_what_came(
    ib_pool, ops_user, team, settings
):
    run = start(ib_pool, ops_user, team)
    report(run, {1: 1.3, 2: 1.3}, skip={(4, 2)})  # the last round of candidate 2 never came
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="running")
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="succeeded")
    run.refresh_from_db()
    assert run.launches_done == run.launches_total - 1
    assert runs.tuning_run_judge(run.pk).state == S.JUDGING  # still waiting
    later = timezone.now() + dt.timedelta(seconds=settings.TUNING_OUTPUT_WAIT_S + 1)
    run = runs.tuning_run_judge(run.pk, now=later)
    assert run.state == S.AWAITING_APPROVAL and run.result["chosen"] == 1
    assert "4 rounds" in run.result["not_judged"][run.candidates[2]["label"]]


def test_ops_may_decline_and_the_baseline_stays(ib_pool, ops_user, team):
    run = start(ib_pool, ops_user, team)
    report(run, {3: 1.3})
    run = runs.tuning_run_decline(run=measured(run), by=ops_user, reason="not in a change window")
    assert run.state == S.DECLINED and "not in a change window" in run.state_reason
    assert not NcclProfile.objects.filter(pool=ib_pool).exists()


def test_the_run_follows_its_job_and_a_requeue_drops_the_figures(ib_pool, ops_user, team):
    run = start(ib_pool, ops_user, team)
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="running")
    report(run, {})
    runs.tuning_runs_follow_jobs(job_ids=[run.job_id], to="pending", reason="node lost")
    run.refresh_from_db()
    assert run.state == S.QUEUED and not TuningMeasurement.objects.filter(run=run).exists()
    transitions.job_transition(job=run.job, to=JobState.CANCELLED, reason="not now", by=ops_user)
    run.refresh_from_db()
    assert run.state == S.CANCELLED and "not now" in run.state_reason
    assert [e.to_state for e in run.events.all()] == [S.QUEUED, S.RUNNING, S.QUEUED, S.CANCELLED]


def test_a_profile_keeps_its_versions_and_one_action_restores_an_earlier_one(ops_user):
    profile = NcclProfile.objects.get(name="efa-p5")
    first = dict(profile.env)
    assert profile.version == 1
    changed = nccl_profile_update(
        profile=profile, by=ops_user, env={**first, "NCCL_DEBUG": "INFO"}, reasons={}
    )
    nccl_profile_update(profile=changed, by=ops_user, title="p5, renamed")  # no new version
    changed.refresh_from_db()
    assert changed.version == 2 and changed.env["NCCL_DEBUG"] == "INFO"
    restored = nccl_profile_version_restore(
        version=NcclProfileVersion.objects.get(profile=profile, number=1), by=ops_user
    )
    assert restored.env == first and restored.version == 3
    latest = NcclProfileVersion.objects.get(profile=profile, number=3)
    assert (latest.source, latest.note, latest.made_by) == (
        VersionSource.RESTORED,
        "version 1 restored",
        ops_user,
    )
    with pytest.raises(ApplicationError):
        nccl_profile_version_restore(version=latest, by=ops_user)  # already current


def adopted(pool, ops_user, team) -> TuningRun:
    run = start(pool, ops_user, team, approval_required=False)
    report(run, {1: 1.3})
    return measured(run)


@pytest.mark.parametrize(("speed", "state"), [(1.0, S.STEADY), (0.7, S.DRIFTED)])
def test_a_drift_check_compares_the_settings_with_the_figures_they_were_adopted_on(
    ib_pool, ops_user, team, speed, state, settings
):
    reference = adopted(ib_pool, ops_user, team)
    settings.TUNING_DRIFT_TEAM = team.slug
    later = timezone.now() + dt.timedelta(seconds=settings.TUNING_DRIFT_EVERY_S + 60)
    assert drift_checks_start(now=later) == 1
    assert drift_checks_start(now=later) == 0  # one at a time per pool
    check = TuningRun.objects.get(kind=TuningRunKind.DRIFT)
    assert check.reference == reference and check.node_ids == reference.node_ids
    assert check.candidates[0]["env"] == reference.candidates[1]["env"]  # what was adopted
    # The adopted candidate measured 1.3 × the old baseline; now it measures `speed` × that.
    report(check, {0: 1.3 * speed}, seed=5)
    check = measured(check)
    assert check.state == state, check.state_reason


def drifted_pool(ib_pool, ops_user, team, settings) -> TuningRun:
    """A pool whose adopted settings were measured again over its 4 nodes, 30% slower."""
    adopted(ib_pool, ops_user, team)
    settings.TUNING_DRIFT_TEAM = team.slug
    later = timezone.now() + dt.timedelta(seconds=settings.TUNING_DRIFT_EVERY_S + 60)
    drift_checks_start(now=later)
    check = TuningRun.objects.get(kind=TuningRunKind.DRIFT)
    report(check, {0: 1.3 * 0.7}, seed=3)
    return measured(check)


def judged(check, speed: float, seed: int) -> dict:
    report(check, {0: 1.3 * speed}, seed=seed)
    measured(check)
    return drift_followup(check.pk)


def test_a_drift_is_bisected_to_the_node_behind_it_which_is_marked_until_a_check_clears_it(
    ib_pool, ops_user, team, settings
):
    top = drifted_pool(ib_pool, ops_user, team, settings)
    assert top.state == S.DRIFTED
    assert drift_followup(top.pk)["started"] == 2
    first, second = top.children.order_by("pk")
    names = list(top.node_names)
    assert [first.node_names, second.node_names] == [names[:2], names[2:]]
    assert first.step == BISECT_PAIRS and first.reference == top.reference
    assert first.job.node_ids == first.node_ids  # pinned to the pair

    # The first pair is slow, the second steady: each node of the slow pair beside a good one.
    assert judged(first, 0.7, seed=11)["started"] == 0  # waits for its sibling
    assert judged(second, 1.0, seed=12)["started"] == 2
    beside = {tuple(r.node_names): r for r in top.children.filter(step=BISECT_AGAINST_GOOD)}
    assert set(beside) == {(names[0], names[2]), (names[1], names[2])}
    assert judged(beside[names[0], names[2]], 0.7, seed=13)["marked"] == [names[0]]
    assert judged(beside[names[1], names[2]], 1.0, seed=14) == {
        "started": 0,
        "marked": [],
        "cleared": [],
    }
    slow = Node.objects.get(name=names[0])
    assert slow.fabric_degraded_reason.startswith("measured slow: drift check #")
    assert not Node.objects.get(name=names[1]).fabric_degraded_since
    # The error counters' all-clear leaves a measured mark alone.
    assert node_fabric_degraded_clear(node_id=slow.pk) is None

    # Ops drain it, repair it, return it: it is measured beside a good node, and cleared.
    node_drain(node=slow, reason="cable swapped", by=ops_user)
    node_undrain(node=Node.objects.get(pk=slow.pk), by=ops_user)
    for run in TuningRun.objects.exclude(state__in=TUNING_FINISHED):
        transitions.job_transition(job=run.job, to=JobState.CANCELLED, reason="done", by=None)
    assert repaired_nodes_check() == 1
    repair = TuningRun.objects.get(step=BISECT_REPAIRED)
    assert repair.node_names[0] == names[0] and repair.node_names[1] != names[0]
    assert judged(repair, 1.0, seed=15)["cleared"] == [names[0]]
    assert Node.objects.get(pk=slow.pk).fabric_degraded_since is None


def test_a_drift_with_every_pair_slow_marks_no_node(ib_pool, ops_user, team, settings):
    top = drifted_pool(ib_pool, ops_user, team, settings)
    drift_followup(top.pk)
    first, second = top.children.order_by("pk")
    judged(first, 0.7, seed=21)
    assert judged(second, 0.7, seed=22) == {"started": 0, "marked": [], "cleared": []}
    assert not Node.objects.filter(pool=ib_pool, fabric_degraded_since__isnull=False).exists()


def test_the_next_job_across_the_pools_nodes_gets_the_adopted_version_and_says_which(
    ib_pool, ops_user, team, researcher, h100_quota, client
):
    run = adopted(ib_pool, ops_user, team)
    # (Its job was never placed here: out of the queue, so that it holds no node.)
    transitions.job_transition(job=run.job, to=JobState.CANCELLED, reason="measured", by=None)
    chosen = run.candidates[run.result["chosen"]]
    spec = command_spec(team, resources={"gpu_type": "H100", "gpus": 16})
    job, _ = job_submit(team=team, spec=spec, submitted_by=researcher)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    plans = list(JobRun.objects.filter(job=job))
    assert len(plans) == 2
    for plan in plans:
        assert (plan.nccl_profile, plan.nccl_profile_version) == ("ib-h100-tuned", 1)
        for name, value in chosen["changes"].items():
            assert plan.plan["env"][name] == value
    client.force_login(researcher)
    page = client.get(f"/jobs/{job.pk}/")
    assert b"NCCL settings from profile" in page.content
    assert b"ib-h100-tuned v1" in page.content
