"""The agents' heartbeats are the truth about processes: a running run its agent no longer
holds is lost and its job follows; a run the agent holds that the control plane does not
want is stopped."""

import datetime as dt

import pytest
from django.core.cache import cache
from django.utils import timezone
from rest_framework.test import APIClient

from apps.fleet import agents
from apps.fleet.agents import AgentIdentity, node_heartbeat_land
from apps.fleet.models import Node
from apps.jobs import services
from apps.jobs.dispatch import (
    NO_LONGER_RUN,
    UNWANTED,
    agent_work,
    job_dispatch,
    run_report,
    runs_reconcile_with_agents,
)
from apps.jobs.models import OPEN_RUN_STATES, Allocation, Job, JobState, Run, RunState
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import trainer_spec

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_heartbeats_left():
    cache.clear()


def running_job(team, user, *, started_ago_s: float = 60) -> tuple[Job, Run]:
    spec = trainer_spec(team, preset="tiny", nodes=1, gpus_per_node=8, seq_len=256)
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=user)
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})
    started = timezone.now() - dt.timedelta(seconds=started_ago_s)
    Run.objects.filter(pk=run.pk).update(started_at=started)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    return job, Run.objects.get(pk=run.pk)


def heartbeat(node_id: int, have: list[int] | None) -> None:
    node = Node.objects.get(pk=node_id)
    report = {"seq": 1, "version": "1", "metrics": {}, "runs": []}
    if have is not None:
        report["have"] = have
    node_heartbeat_land(identity=AgentIdentity(node.pk, str(node.uuid), node.name), report=report)


def test_a_running_run_its_agent_does_not_hold_is_lost_and_its_job_requeued(
    fleet_pool, quota, team, researcher
):
    job, run = running_job(team, researcher)
    heartbeat(run.node_id, have=[])

    assert runs_reconcile_with_agents() == [run.pk]
    run.refresh_from_db()
    job.refresh_from_db()
    assert (run.state, run.reason) == (RunState.LOST, NO_LONGER_RUN)
    assert job.state == JobState.PENDING
    assert job.restarts == 1
    assert NO_LONGER_RUN in job.state_reason and "(infrastructure)" in job.state_reason
    # The lost process held its GPUs; with the job back in the queue they are free.
    assert not Allocation.objects.filter(job=job, ended_at__isnull=True).exists()
    assert not Run.objects.filter(job=job, state__in=OPEN_RUN_STATES).exists()
    assert runs_reconcile_with_agents() == []  # judged once


def test_a_run_held_by_its_agent_is_left_alone(fleet_pool, quota, team, researcher):
    _, run = running_job(team, researcher)
    heartbeat(run.node_id, have=[run.pk])

    assert runs_reconcile_with_agents() == []
    run.refresh_from_db()
    assert run.state == RunState.RUNNING


def test_a_run_started_just_before_the_heartbeat_is_not_judged_by_it(
    fleet_pool, quota, team, researcher
):
    # The agent lists a run as soon as it starts it, but its "running" report goes through
    # the outbox: a heartbeat built before the start can land after the report.
    _, run = running_job(team, researcher, started_ago_s=2)
    heartbeat(run.node_id, have=[])

    assert runs_reconcile_with_agents() == []
    run.refresh_from_db()
    assert run.state == RunState.RUNNING


def test_an_agent_that_does_not_list_its_runs_loses_none(fleet_pool, quota, team, researcher):
    _, run = running_job(team, researcher)
    heartbeat(run.node_id, have=None)
    assert runs_reconcile_with_agents() == []
    heartbeat(run.node_id, have=[run.pk, "x", True, -4])  # junk ids are dropped, not fatal
    assert runs_reconcile_with_agents() == []


def test_a_run_of_a_finished_job_the_agent_still_holds_is_asked_to_stop(
    fleet_pool, quota, team, researcher
):
    job, run = running_job(team, researcher)
    run_report(node_id=run.node_id, run_id=run.pk, report={"state": "exited", "exit_code": 0})
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED

    work = agent_work(node_id=run.node_id, have=[run.pk, 999_999])
    assert work["stop"] == [
        {"id": run.pk, "reason": UNWANTED},
        {"id": 999_999, "reason": UNWANTED},
    ]
    assert agent_work(node_id=run.node_id, have=[])["stop"] == []


def test_after_a_requeue_and_the_next_heartbeat_no_run_of_the_job_stays_open(
    fleet_pool, quota, team, researcher
):
    spec = trainer_spec(team, preset="tiny", nodes=2, gpus_per_node=8, seq_len=256)
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    scheduling_pass()
    job = job_dispatch(job_id=job.pk)
    first, second = Run.objects.filter(job=job).order_by("node_rank")
    for run in (first, second):
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})
    Run.objects.filter(job=job).update(started_at=timezone.now() - dt.timedelta(minutes=1))
    # One rank's node fails under it: the job is requeued, its peer asked to stop...
    report = {"state": "exited", "exit_code": 1, "status": {"reason": "node_lost"}}
    run_report(node_id=first.node_id, run_id=first.pk, report=report)
    job.refresh_from_db()
    assert (job.state, job.restarts) == (JobState.PENDING, 1)
    second.refresh_from_db()
    assert second.state == RunState.RUNNING and second.stop_requested_at is not None

    # ...but its agent restarted and never says the peer ended: the next heartbeat does.
    heartbeat(second.node_id, have=[])
    assert runs_reconcile_with_agents() == [second.pk]
    job.refresh_from_db()
    assert (job.state, job.restarts) == (JobState.PENDING, 1)  # not requeued twice
    assert not Run.objects.filter(job=job, state__in=OPEN_RUN_STATES).exists()
    assert not Allocation.objects.filter(job=job, ended_at__isnull=True).exists()


@pytest.mark.parametrize("have", ["x", "1,,2", "-3", "1.5", ",".join(["1"] * 257), "9" * 19])
def test_a_poll_with_a_bad_have_is_a_400_naming_it(fleet_pool, have):
    node = Node.objects.filter(pool=fleet_pool).first()
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {agents.node_agent_token_issue(node=node)}")
    answer = agent.get("/api/v1/agent/runs/", {"have": have})
    assert answer.status_code == 400, answer.content
    assert "have" in answer.json()["error"]["details"]


def test_a_poll_names_the_runs_held_that_are_not_wanted(fleet_pool, quota, team, researcher):
    _, run = running_job(team, researcher)
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {agents.node_agent_token_issue(node=run.node)}")
    answer = agent.get("/api/v1/agent/runs/", {"have": f"{run.pk},77"})
    assert answer.status_code == 200, answer.content
    assert answer.json()["stop"] == [{"id": 77, "reason": UNWANTED}]


def test_the_heartbeat_sweep_loses_the_runs_its_agents_no_longer_hold(
    fleet_pool, quota, team, researcher
):
    from workers.tasks.fleet import heartbeat_sweep

    job, run = running_job(team, researcher)
    heartbeat(run.node_id, have=[])
    assert heartbeat_sweep()["lost"] == 1
    job.refresh_from_db()
    assert job.state == JobState.PENDING
