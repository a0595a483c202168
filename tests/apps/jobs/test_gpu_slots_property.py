"""No GPU ever has two jobs' processes at once: a property over generated schedules.

Jobs of mixed sizes and priorities are submitted, placed, preempted, cancelled and
requeued, and their nodes' agents start and end runs in any order the machine picks.
After every step: on each node the open allocations hold disjoint GPUs, and every run
that may have a process (planned or running) still holds its allocation, so a GPU is
never handed to a job while another job's process is on it.
"""

import contextlib
import datetime as dt
from collections import defaultdict

import pytest
from django.utils import timezone
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from apps.accounts import services as accounts
from apps.jobs import services
from apps.jobs.dispatch import job_dispatch, run_report
from apps.jobs.models import OPEN_RUN_STATES, Allocation, Job, JobState, Run, RunState
from apps.jobs.scheduler.run import scheduling_pass
from controlplane.errors import ApplicationError
from tests import factories
from tests.apps.fleet.test_services import ready_node
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db

SIZES = {1: {"gpus": 1}, 2: {"gpus": 2}, 3: {"gpus": 3}, 4: {"gpus": 4}, 8: {"nodes": 2}}


class Schedules(RuleBasedStateMachine):
    team = researcher = None  # set by the test

    def __init__(self):
        super().__init__()
        Run.objects.all().delete()
        Allocation.objects.all().delete()
        Job.objects.all().delete()

    def _jobs(self, *states) -> list[Job]:
        return list(Job.objects.filter(state__in=states).order_by("pk"))

    @rule(
        size=st.sampled_from(sorted(SIZES)), priority=st.sampled_from(["low", "normal", "urgent"])
    )
    def submit(self, size, priority):
        wanted = SIZES[size]
        resources = (
            {"gpu_type": "H100", "nodes": 2, "gpus_per_node": 4}
            if "nodes" in wanted
            else {"gpu_type": "H100", "gpus": wanted["gpus"]}
        )
        services.job_submit(
            team=self.team,
            spec=command_spec(self.team, priority=priority, resources=resources),
            submitted_by=self.researcher,
        )

    @rule()
    def schedule(self):
        scheduling_pass()
        for job in self._jobs(JobState.ADMITTED):
            job_dispatch(job_id=job.pk)

    @rule(data=st.data())
    def agent_starts_a_run(self, data):
        planned = list(Run.objects.filter(state=RunState.PLANNED, stop_requested_at=None))
        if planned:
            run = data.draw(st.sampled_from(planned))
            run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 7})

    @rule(data=st.data(), how=st.sampled_from(["ok", "error", "infrastructure", "signal"]))
    def a_process_ends(self, data, how):
        running = list(Run.objects.filter(state=RunState.RUNNING).order_by("pk"))
        if not running:
            return
        run = data.draw(st.sampled_from(running))
        report = {"state": "exited", "exit_code": 0 if how == "ok" else 1}
        if how == "infrastructure":
            report["status"] = {"reason": "collective_timeout"}
        if how == "signal":
            report.update(exit_code=None, signal=9)
        run_report(node_id=run.node_id, run_id=run.pk, report=report)

    @rule(data=st.data())
    def someone_cancels(self, data):
        live = list(Job.objects.live().order_by("pk"))
        if live:
            job = data.draw(st.sampled_from(live))
            with contextlib.suppress(ApplicationError):  # a state cancel cannot leave
                services.job_cancel(job=job, by=None)

    @rule()
    def the_grace_period_passes(self):
        services.jobs_reconcile(now=timezone.now() + dt.timedelta(hours=1))

    @invariant()
    def no_gpu_has_two_jobs(self):
        held: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for node_id, job_id, mask in Allocation.objects.filter(ended_at=None).values_list(
            "node_id", "job_id", "gpu_slots"
        ):
            held[node_id].append((job_id, mask))
        for node_id, rows in held.items():
            taken = 0
            for job_id, mask in rows:
                assert mask, f"job {job_id} holds GPUs on node {node_id} without slots"
                assert not taken & mask, f"node {node_id}: {rows}"
                taken |= mask
        for run in Run.objects.filter(state__in=OPEN_RUN_STATES).select_related("allocation"):
            assert run.allocation is not None and run.allocation.ended_at is None, (
                f"run {run.pk} of job {run.job_id} may still have a process, but its GPUs were "
                "handed back"
            )


def test_no_gpu_ever_has_two_jobs_processes(team, researcher):
    site = factories.make_site(slug="slots-site")
    rack = factories.make_rack(site=site, name="S1")
    pool = factories.make_owned_pool(site=site, slug="slots-owned")
    for unit in range(2):
        ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4, gpu_count=4)
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    Schedules.team, Schedules.researcher = team, researcher
    run_state_machine_as_test(
        Schedules,
        settings=settings(max_examples=25, stateful_step_count=30, deadline=None),
    )
