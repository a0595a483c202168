"""Placements written while the planner still walks the queue (apply.PlacementWriter).

On PostgreSQL a thread applies the placements `plan()` has made so far, a chunk at a
time, on the pass's connection and inside its transaction. These tests shrink the chunk
so a small fleet makes many of them, and check the outcome against one write after the
walk, and that a failure on either side leaves nothing behind.
"""

import sys
import threading
import time

import pytest
from django.db import connection, transaction

from apps.fleet.models import Node, NodeEvent, NodeState
from apps.jobs import services
from apps.jobs.models import Allocation, Job, JobEvent, JobState
from apps.jobs.scheduler import apply, run
from apps.jobs.scheduler.run import scheduling_pass
from apps.jobs.scheduler.snapshot import Decisions
from tests import factories
from tests.apps.fleet.test_services import ready_node
from tests.apps.jobs.conftest import command_spec

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

SIZES = [1, 2, 8, 4, 16, 1, 3, 8, 2, 24, 8, 1, 4, 2, 8, 16, 1, 6, 8, 2]


class Rollback(Exception):
    pass


class SlowWalk(list):
    """The placements list of a walk that takes a while between placements, as the
    walk over a long queue does: a small fleet's walk would otherwise end before the
    thread's first look."""

    def append(self, placement):
        super().append(placement)
        time.sleep(0.004)


@pytest.fixture
def many_placements(team, researcher, monkeypatch):
    """Sixteen 8-GPU nodes in two racks, twenty jobs of 1 to 24 GPUs, and chunks of three
    placements, so a pass writes in several chunks while it plans."""
    from apps.accounts import services as accounts

    site = factories.make_site(slug="writer-site")
    pool = factories.make_owned_pool(site=site, slug="writer-h100")
    for r in range(2):
        rack = factories.make_rack(site=site, name=f"W{r}")
        for unit in range(8):
            ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4, gpu_count=8)
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=128, by=None)
    for i, gpus in enumerate(SIZES):
        resources = (
            {"gpu_type": "H100", "gpus": gpus}
            if gpus <= 8
            else {"gpu_type": "H100", "nodes": gpus // 8, "gpus_per_node": 8}
        )
        services.job_submit(
            team=team,
            spec=command_spec(team, name=f"job-{i}", resources=resources),
            submitted_by=researcher,
        )
    monkeypatch.setattr(apply.PlacementWriter, "CHUNK", 3)
    monkeypatch.setattr(apply.PlacementWriter, "POLL_S", 0.001)
    monkeypatch.setattr(run, "Decisions", lambda: Decisions(placements=SlowWalk()))
    return pool


def _outcome() -> dict:
    """What a pass wrote, in terms that do not depend on row ids or times."""
    names = dict(Job.objects.values_list("id", "name"))
    return {
        "states": dict(Job.objects.values_list("name", "state")),
        "allocations": sorted(
            (names[job], node, gpus)
            for job, node, gpus in Allocation.objects.values_list("job_id", "node_id", "gpus")
        ),
        "busy": sorted(Node.objects.filter(state=NodeState.BUSY).values_list("id", flat=True)),
        "admitted_events": JobEvent.objects.filter(to_state=JobState.ADMITTED).count(),
        "busy_events": NodeEvent.objects.filter(to_state=NodeState.BUSY).count(),
    }


def _pass_outcome(monkeypatch, *, threaded: bool) -> tuple[dict, list[str]]:
    """Run a pass in a transaction, note what it wrote and on which threads the chunks
    were applied, then roll it back."""
    threads: list[str] = []
    real = apply._apply_placements

    def noting_thread(placements, **kwargs):
        threads.append(threading.current_thread().name)
        return real(placements, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(apply, "_apply_placements", noting_thread)
        if not threaded:
            patch.setattr(apply.PlacementWriter, "start", lambda self: None)
        with pytest.raises(Rollback), transaction.atomic():
            report = scheduling_pass()
            outcome = _outcome()
            outcome["placed"] = report.placed
            raise Rollback
    return outcome, threads


def test_chunks_written_while_planning_match_one_write_after_it(many_placements, monkeypatch):
    interval = sys.getswitchinterval()
    threaded, threads = _pass_outcome(monkeypatch, threaded=True)
    assert sys.getswitchinterval() == interval
    assert not connection.allow_thread_sharing
    assert Allocation.objects.count() == 0  # rolled back
    after, one_write = _pass_outcome(monkeypatch, threaded=False)

    assert threaded == after
    assert threaded["placed"] >= 10 and threaded["admitted_events"] == threaded["placed"]
    # The same nodes are busy and none holds more GPUs than it has.
    held: dict[int, int] = {}
    for _, node, gpus in threaded["allocations"]:
        held[node] = held.get(node, 0) + gpus
    assert set(held) == set(threaded["busy"]) and max(held.values()) <= 8
    assert len(threads) > 1 and set(threads) == {"placement-writer"}
    assert one_write == [threading.current_thread().name]


def test_a_chunk_that_fails_rolls_back_the_whole_pass(many_placements, monkeypatch):
    real = apply._apply_placements
    calls = []

    def fail_second(placements, **kwargs):
        calls.append(len(placements))
        if len(calls) == 2:
            raise RuntimeError("the database went away mid-pass")
        return real(placements, **kwargs)

    monkeypatch.setattr(apply, "_apply_placements", fail_second)
    with pytest.raises(RuntimeError, match="went away"):
        scheduling_pass()
    assert len(calls) == 2
    assert not Allocation.objects.exists()
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}
    assert not Node.objects.filter(state=NodeState.BUSY).exists()
    assert not JobEvent.objects.filter(to_state=JobState.ADMITTED).exists()
    assert not connection.allow_thread_sharing


def test_a_plan_that_fails_stops_the_writer_and_leaves_nothing(many_placements, monkeypatch):
    real_plan = run.plan
    written = []
    real = apply._apply_placements

    def noting(placements, **kwargs):
        real(placements, **kwargs)
        written.append(len(placements))

    def plan_then_fail(snapshot, out=None):
        real_plan(snapshot, out=out)
        deadline = time.monotonic() + 5
        while not written and time.monotonic() < deadline:
            time.sleep(0.005)  # the writer has applied a chunk while the walk "went on"
        raise ValueError("the planner hit a bug")

    monkeypatch.setattr(apply, "_apply_placements", noting)
    monkeypatch.setattr(run, "plan", plan_then_fail)
    with pytest.raises(ValueError, match="planner"):
        scheduling_pass()
    assert written  # something had been written before the walk failed
    assert not Allocation.objects.exists()
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}
    assert not connection.allow_thread_sharing
