"""A whole scheduling pass on the database: read the snapshot, plan, apply."""

import pytest

from apps.accounts import services as accounts
from apps.accounts.models import TeamRole
from apps.fleet import services as fleet
from apps.fleet.models import JobIsolation, Node, NodeState, Tenancy
from apps.fleet.services import node_drain
from apps.jobs import services, transitions
from apps.jobs.models import Allocation, Job, JobEvent, JobState, TeamUsage
from apps.jobs.scheduler.apply import _dispatch_soon, dispatch_batches_send
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


def submit(team, user, **overrides):
    job, _ = services.job_submit(team=team, spec=command_spec(team, **overrides), submitted_by=user)
    return job


def test_a_pass_places_a_gang_and_marks_its_nodes_busy(fleet_pool, quota, team, researcher):
    job = submit(team, researcher, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    report = scheduling_pass()
    assert report.placed == 1
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED and job.pool == fleet_pool
    allocations = list(Allocation.objects.filter(job=job))
    assert len(allocations) == 2 and {a.gpus for a in allocations} == {8}
    assert len({a.node_id for a in allocations}) == 2
    for allocation in allocations:
        assert Node.objects.get(pk=allocation.node_id).state == NodeState.BUSY
    assert JobEvent.objects.filter(job=job, to_state=JobState.ADMITTED).exists()


def test_a_pass_that_fails_after_placing_leaves_nothing_behind(
    fleet_pool, quota, team, researcher, monkeypatch
):
    from apps.jobs.scheduler import apply

    job = submit(team, researcher)

    def fail(*args, **kwargs):
        raise RuntimeError("the database went away mid-pass")

    monkeypatch.setattr(apply, "_apply_reasons", fail)  # after the placements are written
    with pytest.raises(RuntimeError, match="went away"):
        scheduling_pass()
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert not Allocation.objects.exists()
    assert not Node.objects.filter(state=NodeState.BUSY).exists()
    assert not JobEvent.objects.filter(to_state=JobState.ADMITTED).exists()


def test_a_job_that_does_not_fit_now_waits_with_a_reason(fleet_pool, quota, team, researcher):
    big = submit(
        team, researcher, name="big", resources={"gpu_type": "H100", "nodes": 3, "gpus_per_node": 8}
    )
    other = submit(
        team,
        researcher,
        name="other",
        resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8},
    )
    scheduling_pass()
    big.refresh_from_db()
    other.refresh_from_db()
    assert big.state == JobState.ADMITTED
    assert other.state == JobState.PENDING
    assert other.pending_reason and "waiting for the next" not in other.pending_reason


def test_a_waiting_job_placed_later_leaves_its_wait_row(fleet_pool, quota, team, researcher):
    from apps.jobs.models import JobWait

    three = {"gpu_type": "H100", "nodes": 3, "gpus_per_node": 8}
    big = submit(team, researcher, name="big", resources=three)
    other = submit(team, researcher, name="other", resources=three)
    scheduling_pass()
    assert JobWait.objects.filter(job=other).exists() and not JobWait.objects.filter(job=big)
    services.job_cancel(job=big, by=researcher)
    assert scheduling_pass().placed == 1
    other.refresh_from_db()
    assert other.state == JobState.ADMITTED
    assert not JobWait.objects.filter(job=other).exists()


def test_the_quota_holds_jobs_back(fleet_pool, team, researcher):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    first = submit(team, researcher, name="first")
    second = submit(team, researcher, name="second")
    scheduling_pass()
    states = dict(Job.objects.values_list("name", "state"))
    assert states == {"first": JobState.ADMITTED, "second": JobState.PENDING}
    second.refresh_from_db()
    assert "quota" in second.pending_reason
    services.job_cancel(job=first, by=None)
    scheduling_pass()
    second.refresh_from_db()
    assert second.state == JobState.ADMITTED


def test_a_drained_node_takes_no_work_and_cancel_frees_gpus(
    fleet_pool, quota, team, researcher, ops_user
):
    for node in Node.objects.filter(pool=fleet_pool)[:3]:
        node_drain(node=node, reason="maintenance", by=ops_user)
    job = submit(team, researcher, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    one = submit(team, researcher, name="one")
    scheduling_pass()
    one.refresh_from_db()
    assert one.state == JobState.ADMITTED
    services.job_cancel(job=one, by=researcher)
    assert not Allocation.objects.filter(job=one, ended_at__isnull=True).exists()
    node = Node.objects.get(pool=fleet_pool, state=NodeState.READY)
    assert not node.allocations.filter(ended_at__isnull=True).exists()


def test_a_second_pass_rewrites_only_changed_reasons(fleet_pool, team, researcher):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    for i in range(4):
        submit(team, researcher, name=f"j{i}")
    first = scheduling_pass()
    second = scheduling_pass()
    assert first.reasons_written == 3
    assert second.reasons_written == 0


def test_usage_accumulates_for_fair_share(
    fleet_pool, quota, team, researcher, django_capture_on_commit_callbacks
):
    submit(team, researcher)
    with django_capture_on_commit_callbacks(execute=True):  # as each pass commits
        scheduling_pass()
    assert not TeamUsage.objects.filter(team=team).exists()  # nothing held before it
    scheduling_pass()
    assert TeamUsage.objects.filter(team=team).exists()


def test_a_rolled_back_pass_leaves_the_last_pass_time_alone(fleet_pool, quota, team, researcher):
    """The next pass adds usage since the last pass that committed, and a job's reason
    is read against it (Job.pending_reason): a pass rolled back must not move it."""
    from django.core.cache import cache
    from django.db import transaction

    from apps.jobs.models.jobs import LAST_PASS_KEY

    cache.set(LAST_PASS_KEY, 1.0)
    submit(team, researcher)
    with pytest.raises(RuntimeError), transaction.atomic():
        scheduling_pass()
        raise RuntimeError("the pass's transaction fails after the apply")
    assert cache.get(LAST_PASS_KEY) == 1.0


def test_a_held_job_is_never_placed(fleet_pool, quota, team, researcher):
    job = submit(team, researcher)
    services.job_hold(job=job, by=researcher)
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == JobState.HELD


def test_the_schedule_task_runs_a_pass(fleet_pool, quota, team, researcher):
    from workers.tasks.jobs import schedule

    submit(team, researcher)
    result = schedule()
    assert result["placed"] == 1


def test_urgent_preempts_low_that_has_not_started(fleet_pool, team, researcher):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    low = submit(
        team,
        researcher,
        name="low",
        priority="low",
        resources={"gpu_type": "H100", "nodes": 4, "gpus_per_node": 8},
    )
    scheduling_pass()
    low.refresh_from_db()
    assert low.state == JobState.ADMITTED
    urgent = submit(
        team,
        researcher,
        name="urgent",
        priority="urgent",
        resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8},
    )
    scheduling_pass()
    low.refresh_from_db()
    assert low.state == JobState.PENDING  # not started yet: straight back to the queue
    assert JobEvent.objects.filter(job=low, to_state=JobState.PENDING).count() == 2
    scheduling_pass()
    urgent.refresh_from_db()
    assert urgent.state == JobState.ADMITTED


def _queued_messages() -> int:
    """Messages waiting in the real broker: files in the filesystem queue, or Redis' list."""
    from pathlib import Path

    from django.conf import settings

    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"])
        return len(list(folder.glob("*"))) if folder.exists() else 0
    import redis

    return redis.Redis.from_url(settings.CELERY_BROKER_URL).llen("celery")


def test_a_burst_of_submits_asks_for_one_pass(
    fleet_pool, quota, team, researcher, django_capture_on_commit_callbacks
):
    from django.core.cache import cache

    cache.delete("jobs:schedule:queued")
    transitions._asked_at[0] = float("-inf")  # forget what earlier tests in this process asked
    before = _queued_messages()
    with django_capture_on_commit_callbacks(execute=True):
        for i in range(100):
            submit(team, researcher, name=f"burst-{i}")
    assert _queued_messages() - before == 1


def test_a_changed_reason_replaces_the_stored_one(fleet_pool, team, researcher):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    jobs = [submit(team, researcher, name=f"j{i}") for i in range(3)]
    first = scheduling_pass()
    assert first.reasons_written == 2
    last = Job.objects.get(pk=jobs[2].pk)
    before = last.pending_reason
    assert "quota" in before
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=16, by=None)
    second = scheduling_pass()
    assert second.placed == 1 and second.reasons_written == 1
    last = Job.objects.get(pk=jobs[2].pk)
    assert last.state == JobState.PENDING
    assert "quota" in last.pending_reason and last.pending_reason != before


def _node_updates() -> tuple[int, int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
            "WHERE relname = 'fleet_node'"
        )
        return cursor.fetchone()


@pytest.mark.postgres
def test_nodes_marked_busy_are_rewritten_in_place(fleet_pool, quota, team, researcher):
    """No index covers a node's state and its pages have room (fleet migration 0006),
    so PostgreSQL updates each node in place (HOT) instead of in all its indexes."""
    for i in range(4):
        submit(team, researcher, name=f"whole-node-{i}")
    updated, in_place = _node_updates()
    report = scheduling_pass()
    assert report.placed == 4
    assert Node.objects.filter(pool=fleet_pool, state=NodeState.BUSY).count() == 4
    updated_after, in_place_after = _node_updates()
    assert updated_after - updated == 4
    assert in_place_after - in_place == 4


def test_a_pass_pauses_the_cycle_collector_and_restores_it(
    fleet_pool, quota, team, researcher, monkeypatch
):
    import gc

    from apps.jobs.scheduler import run

    seen = []
    real_plan = run.plan

    def plan_watching_the_collector(snapshot):
        seen.append(gc.isenabled())
        return real_plan(snapshot)

    monkeypatch.setattr(run, "plan", plan_watching_the_collector)
    submit(team, researcher)
    assert gc.isenabled()
    scheduling_pass()
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that had it off gets it back off
    try:
        scheduling_pass()
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_a_deleted_job_takes_its_wait_row_along(fleet_pool, team, researcher):
    """JobWait has no foreign key in the database (migration jobs 0006); Django's
    CASCADE still removes a job's wait row with the job."""
    from apps.jobs.models import JobWait

    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    submit(team, researcher, name="placed")
    waiting = submit(team, researcher, name="waiting")
    scheduling_pass()
    assert JobWait.objects.filter(job=waiting).exists()
    Job.objects.filter(pk=waiting.pk).delete()
    assert not JobWait.objects.filter(job_id=waiting.pk).exists()


def test_jobs_and_nodes_with_allocations_are_still_protected(
    fleet_pool, quota, team, researcher, ops_user
):
    """Allocations and node events have no foreign keys in the database (jobs and fleet
    migrations 0008): Django's PROTECT and CASCADE still hold."""
    from django.db.models import ProtectedError

    from apps.fleet.models import NodeEvent

    job = submit(team, researcher)
    scheduling_pass()
    allocation = Allocation.objects.get(job=job)
    with pytest.raises(ProtectedError):
        Job.objects.filter(pk=job.pk).delete()
    with pytest.raises(ProtectedError):
        Node.objects.filter(pk=allocation.node_id).delete()
    idle = Node.objects.filter(pool=fleet_pool).exclude(pk=allocation.node_id).first()
    node_drain(node=idle, by=ops_user, reason="maintenance")
    assert NodeEvent.objects.filter(node=idle).exists()
    Node.objects.filter(pk=idle.pk).delete()
    assert not NodeEvent.objects.filter(node_id=idle.pk).exists()


def test_a_jobs_events_and_pool_references_still_hold_without_database_constraints(
    fleet_pool, quota, team, researcher, ops_user
):
    """JobEvent.job and Job.pool have no foreign keys in the database (jobs migration
    0009): deleting a job through Django still removes its events, and a pool with nodes
    still cannot be deleted, so no placed job points at a pool that is gone."""
    from apps.fleet.services import pool_delete
    from apps.jobs.models import JobEvent
    from controlplane.errors import ApplicationError

    placed = submit(team, researcher)
    scheduling_pass()
    placed.refresh_from_db()
    assert placed.pool_id == fleet_pool.pk
    with pytest.raises(ApplicationError, match="still used by nodes"):
        pool_delete(pool=fleet_pool, by=ops_user)
    waiting = submit(team, researcher)
    assert JobEvent.objects.filter(job=waiting).exists()
    Job.objects.filter(pk=waiting.pk).delete()  # never placed: nothing protects it
    assert not JobEvent.objects.filter(job_id=waiting.pk).exists()


def _broker_messages() -> list[tuple[str, list[int], str]]:
    """(task, first argument, argsrepr) of every message on the broker's default queue,
    taken off it."""
    from controlplane.celery import app

    found = []
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue("celery")
        try:
            while True:
                message = queue.get(timeout=2)
                message.ack()
                args, _, _ = message.decode()
                found.append((message.headers["task"], args[0], message.headers["argsrepr"]))
        except queue.Empty:
            pass
        finally:
            queue.close()
    return found


def test_placed_jobs_reach_the_broker_in_one_message_then_in_batches_of_ids(
    django_capture_on_commit_callbacks,
):
    """What the dispatch hand-off puts on the real broker: a pass that placed more jobs
    than one batch sends one fan-out message with every id, and the fan-out task sends
    every id once, in batches, each message with a short argsrepr rather than its ids.
    (The filesystem broker may hand back messages sent in the same millisecond in
    another order.)"""
    from controlplane.celery import app
    from workers.tasks.jobs import dispatch_many

    with app.connection_for_write() as connection:
        connection.SimpleQueue("celery").clear()  # what earlier tests' passes handed over
    ids = list(range(10_001, 10_451))
    with django_capture_on_commit_callbacks(execute=True):
        _dispatch_soon(ids, batch=200)
    assert _broker_messages() == [("jobs.dispatch_many", ids, "[450 job ids from 10001]")]

    assert dispatch_batches_send(ids, batch=200) == 3
    assert sorted(_broker_messages()) == [
        ("jobs.dispatch", ids[:200], "[200 job ids from 10001]"),
        ("jobs.dispatch", ids[200:400], "[200 job ids from 10201]"),
        ("jobs.dispatch", ids[400:], "[50 job ids from 10401]"),
    ]
    # The task itself splits by the module's batch size.
    assert dispatch_many.run(ids) == 3
    assert sorted(len(args) for _, args, _ in _broker_messages()) == [50, 200, 200]


def test_a_pass_that_placed_one_batch_or_fewer_sends_the_dispatch_itself(
    django_capture_on_commit_callbacks,
):
    from controlplane.celery import app

    with app.connection_for_write() as connection:
        connection.SimpleQueue("celery").clear()
    with django_capture_on_commit_callbacks(execute=True):
        _dispatch_soon([7, 8, 9], batch=200)
    assert _broker_messages() == [("jobs.dispatch", [7, 8, 9], "[3 job ids from 7]")]


def test_usage_adds_what_each_team_held_since_the_last_pass(
    team, other_team, django_capture_on_commit_callbacks
):
    import datetime as dt

    from django.core.cache import cache
    from django.utils import timezone

    from apps.jobs.scheduler.apply import LAST_PASS_KEY, _advance_usage
    from apps.jobs.scheduler.read import ReadContext, decay_scale

    now = timezone.now()
    held = {team.pk: 8, other_team.pk: 16}
    cache.set(LAST_PASS_KEY, (now - dt.timedelta(seconds=100)).timestamp())
    with django_capture_on_commit_callbacks(execute=True):  # the pass's time, once committed
        _advance_usage(ReadContext(now=now, reasons={}, held_by_team=held))
    later = now + dt.timedelta(seconds=50)
    _advance_usage(ReadContext(now=later, reasons={}, held_by_team={team.pk: 8}))
    stored = dict(TeamUsage.objects.values_list("team_id", "scaled_gpu_seconds"))
    # Stored scaled to the epoch: ÷ the scale at each moment gives GPU-seconds then.
    assert stored[team.pk] == pytest.approx(
        8 * 100 * decay_scale(now) + 8 * 50 * decay_scale(later)
    )
    assert stored[other_team.pk] == pytest.approx(16 * 100 * decay_scale(now))
    assert TeamUsage.objects.get(team=team).updated_at == later


def test_jobs_past_the_backfill_depth_keep_no_wait_row_and_read_as_such(
    settings, fleet_pool, team, researcher, api_for, django_capture_on_commit_callbacks
):
    """Most of a long queue lies past the backfill depth: the pass stores no reason for
    those jobs, a job that falls past it loses the row it had, and readers (model, API,
    queue) still say why each waits."""
    from apps.jobs.models import JobWait
    from apps.jobs.models.jobs import NOT_YET_PLANNED
    from apps.jobs.scheduler.snapshot import BEYOND_DEPTH
    from apps.jobs.selectors import queue_for

    settings.BACKFILL_DEPTH = 1
    client = api_for(researcher)
    # A list answered before any pass (no last-pass time yet) must not stick to later ones.
    assert client.get("/api/v1/jobs/").status_code == 200
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    whole = {"gpu_type": "H100", "nodes": 4, "gpus_per_node": 8}
    # Fills the four nodes; urgent, so nothing preempts it.
    submit(team, researcher, name="whole", resources=whole, priority="urgent")
    waiting = [submit(team, researcher, name=f"w{i}") for i in range(4)]
    with django_capture_on_commit_callbacks(execute=True):
        report = scheduling_pass()
    assert report.placed == 1
    # The first blocked job and one more are tried; the other two are not.
    assert report.reasons_written == 2
    rows = set(JobWait.objects.values_list("job_id", flat=True))
    assert rows == {waiting[0].pk, waiting[1].pk}
    for job in waiting[2:]:
        job.refresh_from_db()
        assert job.pending_reason == BEYOND_DEPTH
    late = submit(team, researcher, name="late")
    assert late.pending_reason == NOT_YET_PLANNED

    # A high job goes first: w1, tried before, is now past the depth.
    high = submit(team, researcher, name="high", priority="high")
    with django_capture_on_commit_callbacks(execute=True):
        second = scheduling_pass()
    rows = set(JobWait.objects.values_list("job_id", flat=True))
    assert rows == {high.pk, waiting[0].pk}
    assert second.reasons_written == 2  # the high job's first reason; w1's row gone
    answer = client.get("/api/v1/jobs/", {"state": "pending"}).json()
    reasons = {job["name"]: job["pending_reason"] for job in answer["results"]}
    assert reasons["w1"] == reasons["w3"] == reasons["late"] == BEYOND_DEPTH
    assert {reasons["high"], reasons["w0"]}.isdisjoint({BEYOND_DEPTH, NOT_YET_PLANNED})
    queued = {row["name"]: row["reason"] for row in queue_for(user=researcher)}
    assert queued["w2"] == BEYOND_DEPTH and queued["w0"] == reasons["w0"]


def _one_gpu_jobs_of_two_teams(team, other_team, researcher) -> list[Job]:
    other = factories.make_member(team=other_team, role=TeamRole.RESEARCHER)
    jobs = []
    for who, by in ((team, researcher), (other_team, other)):
        accounts.team_quota_set(team=who, gpu_type="H100", max_gpus=8, by=None)
        jobs.append(
            submit(who, by, name=f"{who.slug}-one", resources={"gpu_type": "H100", "gpus": 1})
        )
    return jobs


def _nodes_of(jobs) -> list[int]:
    return [Allocation.objects.get(job=job, ended_at__isnull=True).node_id for job in jobs]


def test_two_teams_get_two_nodes_of_a_pool_of_one_team_per_node(
    fleet_pool, team, other_team, researcher
):
    jobs = _one_gpu_jobs_of_two_teams(team, other_team, researcher)
    assert scheduling_pass().placed == 2
    first, second = _nodes_of(jobs)
    assert first != second


def test_two_teams_share_a_node_of_a_shared_pool_whose_agents_run_jobs_as_users(
    fleet_pool, team, other_team, researcher, ops_user
):
    fleet.pool_update(pool=fleet_pool, tenancy=Tenancy.SHARED, by=ops_user)
    # What each node's agent reports when it registers (apps/fleet/agents.py).
    Node.objects.filter(pool=fleet_pool).update(job_isolation=JobIsolation.USER)
    jobs = _one_gpu_jobs_of_two_teams(team, other_team, researcher)
    assert scheduling_pass().placed == 2
    first, second = _nodes_of(jobs)
    assert first == second


def test_a_placed_job_whose_dispatch_was_lost_is_dispatched_within_fifteen_seconds(
    fleet_pool, quota, team, researcher, settings
):
    import datetime as dt

    from django.utils import timezone

    from workers.tasks.jobs import redispatch

    job = submit(team, researcher)
    scheduling_pass()  # placed; suppose its dispatch message is lost with its worker
    assert redispatch() == {"dispatched": 0}  # too soon: its own dispatch may be under way
    placed = timezone.now() - dt.timedelta(seconds=settings.DISPATCH_REDRIVE_S + 1)
    Job.objects.filter(pk=job.pk).update(state_changed_at=placed)
    assert redispatch() == {"dispatched": 1}
    job.refresh_from_db()
    assert job.state == JobState.STARTING
    beat = settings.CELERY_BEAT_SCHEDULE["jobs-redispatch"]
    assert settings.DISPATCH_REDRIVE_S + beat["schedule"] <= 15
