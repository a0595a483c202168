"""Reading the scheduler's snapshot (scheduler/read.py): which nodes may hold several
teams' jobs, and the pending jobs kept between passes on PostgreSQL (KeptPending), where
what a pass reads from what it kept must be what reading every row gives."""

import datetime as dt

import pytest
from django.db import transaction
from django.utils import timezone

from apps.fleet.models import JobIsolation, Node, Tenancy
from apps.jobs import services
from apps.jobs.models import Job
from apps.jobs.scheduler import read
from apps.jobs.scheduler.read import read_snapshot
from tests import factories
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


def always(**_):
    return True


@pytest.fixture
def kept():
    read._kept.clear()
    yield read._kept
    read._kept.clear()


def pending(budget_left=always) -> set:
    snapshot, _ = read_snapshot(now=timezone.now(), budget_left=budget_left)
    return set(snapshot.pending)


def pending_read_whole(budget_left=always) -> set:
    read._kept.clear()
    return pending(budget_left)


@pytest.mark.parametrize("local_jobs_can_read_each_other", [False, True])
def test_a_node_is_shared_only_where_its_pool_and_its_agent_allow_it(
    settings, local_jobs_can_read_each_other
):
    settings.LOCAL_JOBS_CAN_READ_EACH_OTHER = local_jobs_can_read_each_other
    expected = {}
    for tenancy in Tenancy.values:
        pool = factories.make_owned_pool(tenancy=tenancy)
        for isolation in JobIsolation.values:
            for provider in ("local", "ssh"):
                node = factories.make_node(pool=pool)
                Node.objects.filter(pk=node.pk).update(job_isolation=isolation, provider=provider)
                expected[node.pk] = (
                    tenancy == Tenancy.SHARED and isolation == JobIsolation.USER
                ) or (local_jobs_can_read_each_other and provider == "local")
    snapshot, _ = read_snapshot(now=timezone.now(), budget_left=always)
    assert {n.id: n.shared for n in snapshot.nodes} == expected
    assert sum(expected.values()) == (7 if local_jobs_can_read_each_other else 2)


def test_an_owned_node_takes_work_only_while_its_agent_isolates_jobs():
    """A local node says how it runs jobs and takes work either way (development); an owned
    or cloud node whose agent has not said it runs each job as its own user takes none."""
    pool = factories.make_owned_pool()
    expected = {}
    for isolation in JobIsolation.values:
        for provider in ("local", "ssh"):
            node = factories.make_node(pool=pool)
            Node.objects.filter(pk=node.pk).update(
                job_isolation=isolation, provider=provider, state="ready"
            )
            expected[node.pk] = provider == "local" or isolation == JobIsolation.USER
    snapshot, _ = read_snapshot(now=timezone.now(), budget_left=always)
    assert {n.id: n.schedulable for n in snapshot.nodes} == expected


def submit(team, user, name):
    job, _ = services.job_submit(team=team, spec=command_spec(team, name=name), submitted_by=user)
    return job


@pytest.mark.postgres
def test_a_pass_reads_only_new_and_changed_rows(kept, fleet_pool, quota, team, researcher):
    jobs = [submit(team, researcher, f"j{i}") for i in range(6)]
    # Written twice by one transaction (the test's), before and after the first read: the
    # two versions share their xmin and differ in where they lie.
    Job.objects.filter(pk=jobs[4].pk).update(time_limit_s=1800)
    first = pending()
    assert {j.job_id for j in first} == {j.pk for j in jobs}
    assert kept.rows_read == 6

    added = submit(team, researcher, "added")
    services.job_cancel(job=jobs[0], by=researcher)
    services.job_hold(job=jobs[1], by=researcher)
    Job.objects.filter(pk=jobs[2].pk).update(priority_class="urgent")  # same transaction
    Job.objects.filter(pk=jobs[3].pk).update(time_limit_s=7200)
    Job.objects.filter(pk=jobs[4].pk).update(time_limit_s=5400)
    now = pending()
    assert kept.rows_read == 4  # the new job and the three changed ones
    assert now == pending_read_whole()
    by_id = {j.job_id: j for j in now}
    assert set(by_id) == {added.pk, jobs[2].pk, jobs[3].pk, jobs[4].pk, jobs[5].pk}
    assert by_id[jobs[2].pk].priority == 3 and by_id[jobs[3].pk].time_limit_s == 7200
    assert by_id[jobs[4].pk].time_limit_s == 5400

    services.job_release(job=jobs[1], by=researcher)
    assert {j.job_id for j in pending()} == set(by_id) | {jobs[1].pk}
    assert kept.rows_read == 1


@pytest.mark.postgres
def test_a_change_rolled_back_is_not_kept(kept, fleet_pool, quota, team, researcher):
    job = submit(team, researcher, "steady")
    pending()
    with pytest.raises(RuntimeError), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(nodes=2)
        assert {j.nodes for j in pending()} == {2}  # read inside the change's transaction
        raise RuntimeError("roll it back")
    assert {j.nodes for j in pending()} == {1}
    assert pending() == pending_read_whole()


@pytest.mark.postgres
def test_each_pass_asks_the_budget_question_again(kept, fleet_pool, quota, team, researcher):
    submit(team, researcher, "a")
    submit(team, researcher, "b")
    assert {j.budget_ok for j in pending()} == {True}
    assert {j.budget_ok for j in pending(lambda **_: False)} == {False}
    assert kept.rows_read == 0  # the answer changed, not the rows
    assert {j.budget_ok for j in pending()} == {True}


@pytest.mark.postgres
def test_what_is_kept_is_read_whole_again_after_a_while(kept, fleet_pool, quota, team, researcher):
    submit(team, researcher, "a")
    submit(team, researcher, "b")
    pending()
    pending()
    assert kept.rows_read == 0
    kept.read_at -= kept.MAX_AGE_S + 1
    pending()
    assert kept.rows_read == 2


def test_a_node_that_missed_a_heartbeat_takes_no_new_work_until_it_answers(settings):
    settings.NODE_QUIET_AFTER_S = 25
    now = timezone.now()
    pool = factories.make_owned_pool()
    answering, quiet, never = (factories.make_node(pool=pool) for _ in range(3))
    Node.objects.filter(pool=pool).update(state="ready", provider="local")
    Node.objects.filter(pk=answering.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=5))
    Node.objects.filter(pk=quiet.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=30))

    def schedulable() -> dict:
        snapshot, _ = read_snapshot(now=now, budget_left=always)
        return {n.id: n.schedulable for n in snapshot.nodes}

    # Still READY (the sweep calls it SUSPECT only after NODE_SUSPECT_AFTER_S), but skipped.
    assert schedulable() == {answering.pk: True, quiet.pk: False, never.pk: True}
    Node.objects.filter(pk=quiet.pk).update(last_heartbeat_at=now)
    assert schedulable()[quiet.pk] is True


def test_a_pinned_job_and_a_degraded_node_come_through_the_snapshot(
    kept, fleet_pool, quota, team, researcher
):
    """Job.node_ids as the set of pinned nodes (None: not pinned), and a node whose fabric
    is degraded (fabric_degraded_since set) as `degraded`."""
    healthy, degraded = (factories.make_node(pool=fleet_pool) for _ in range(2))
    Node.objects.filter(pk=degraded.pk).update(fabric_degraded_since=timezone.now())
    pinned, free = submit(team, researcher, "pinned"), submit(team, researcher, "free")
    Job.objects.filter(pk=pinned.pk).update(node_ids=[healthy.pk, degraded.pk])
    snapshot, _ = read_snapshot(now=timezone.now(), budget_left=always)
    by_id = {j.job_id: j for j in snapshot.pending}
    assert by_id[pinned.pk].node_ids == frozenset({healthy.pk, degraded.pk})
    assert by_id[free.pk].node_ids is None
    flags = {n.id: n.degraded for n in snapshot.nodes}
    assert flags[healthy.pk] is False and flags[degraded.pk] is True
