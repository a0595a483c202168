"""Preemption and node loss on real parts, told by the nodes' own records.

A low-priority trainer job of 2 local nodes x 2 slots is preempted for an urgent job that
needs the same GPUs: it is asked to stop by the scheduling pass that chose it, checkpoints,
goes back to the queue, and its GPUs are handed on only once its processes are gone; it
resumes from that checkpoint when the urgent job is done. A job that may shrink (min_nodes)
loses one of its two nodes outright and resumes on the other from its newest checkpoint,
resharded onto half the ranks. Throughout, each node's agent ledger (runs.jsonl) must show
no GPU slot held by two runs' processes at once.

The tiny preset in fp32 on CPU slots (gloo): a step is a fraction of a second here, so
each job's run is mostly torch's start.
"""

import json
import math
import os
import signal
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import pytest
from django.utils import timezone

from apps.checkpoints.models import Checkpoint
from apps.fleet.models import Node, NodeEvent
from apps.jobs.models import Allocation, Job, JobEvent, LogLine, Run, StepMetric
from apps.jobs.runconfig import checkpoint_dir
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import (
    ENDED,
    agent_ledger,
    log_texts,
    tiny_trainer_spec,
    wait_for,
    workers_of,
)
from tests.e2e.test_command_jobs import _submit
from tests.e2e.test_faults import _agent_pid, _node_state
from workers.agent import isolation
from workers.tasks.fleet import heartbeat_sweep
from workers.tasks.jobs import dispatch_one

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

NODES, SLOTS = 2, 2
STEPS, EVERY = 40, 5  # long enough to be stopped midway; a checkpoint every few steps
ALL_SLOTS = (1 << SLOTS) - 1


# --- processes, as /proc shows them -----------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command's name (the state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


@dataclass(frozen=True)
class Process:
    """A process of this machine, known by its id and its start time (so that an id the
    kernel hands out again is not taken for it)."""

    pid: int
    started: int  # clock ticks after boot

    @classmethod
    def of(cls, pid: int) -> "Process | None":
        fields = _stat(pid)
        return None if fields is None else cls(pid, int(fields[19]))

    def alive(self) -> bool:
        fields = _stat(self.pid)
        return fields is not None and fields[0] != "Z" and int(fields[19]) == self.started


def _processes(job: Job, attempt: int) -> list[Process]:
    """Every node's torchrun and the workers it started, once all of them are up; else []."""
    found: list[Process | None] = []
    runs = list(Run.objects.filter(job=job, attempt=attempt))
    if not runs or any(r.pid is None for r in runs):
        return []
    for run in runs:
        workers = workers_of(run.pid)
        if len(workers) != job.gpus_per_node:
            return []
        found += [Process.of(run.pid), *(Process.of(w.pid) for w in workers)]
    return [] if None in found else found


# --- the agents' ledgers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One run on one node, from the agent's ledger: when its process started, and when
    it and everything it left were gone (inf: the agent never saw it end)."""

    node_id: int
    run: int
    job: int
    slots: frozenset[int]
    started: float
    ended: float


def ledger_spans(nodes) -> list[Span]:
    spans = []
    for node in nodes:
        records = agent_ledger(node)
        ended = {r["run"]: r["at"] for r in records if r["event"] == "ended"}
        spans += [
            Span(
                node.pk,
                r["run"],
                r["job"],
                frozenset(r["slots"]),
                r["at"],
                ended.get(r["run"], math.inf),
            )
            for r in records
            if r["event"] == "started"
        ]
    return spans


def assert_no_slot_held_twice(spans: list[Span]) -> int:
    """No GPU slot of a node ever had two runs' processes at once (two jobs', or two
    attempts of one job). Returns how many pairs of runs shared a slot, one after the other."""
    shared = 0
    for a, b in combinations(spans, 2):
        if a.node_id != b.node_id or not a.slots & b.slots:
            continue
        shared += 1
        assert a.ended <= b.started or b.ended <= a.started, (
            f"node {a.node_id}: slots {sorted(a.slots & b.slots)} held by run {a.run} of job "
            f"{a.job} ({a.started:.3f} to {a.ended:.3f}) and run {b.run} of job {b.job} "
            f"({b.started:.3f} to {b.ended:.3f}) at once"
        )
    return shared


# --- jobs ---------------------------------------------------------------------------------------


def _submitted(api, spec: dict) -> Job:
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(pk=answer.json()["id"])


def _dispatched(job: Job) -> None:
    """Placed by a pass and dispatched as the jobs.dispatch task does: with the checkpoint
    the registry chooses to resume from, asked again while the nodes check it."""
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == "admitted", job.pending_reason
    wait_for(
        f"job {job.pk} to be dispatched", lambda: dispatch_one(job.pk) == "dispatched", 90, 1.0
    )


def _finished(job: Job, timeout_s: float = 300) -> Job:
    try:
        return wait_for(
            f"job {job.pk} to finish",
            lambda: (j := Job.objects.get(pk=job.pk)).state in ENDED and j,
            timeout_s=timeout_s,
            every_s=0.5,
        )
    except AssertionError as error:
        job.refresh_from_db()
        runs = list(Run.objects.filter(job=job).values("attempt", "node_id", "state", "reason"))
        events = list(JobEvent.objects.filter(job=job).values_list("to_state", "reason"))
        raise AssertionError(f"{error}: {job.state} {events} {runs}") from None


def _losses(job: Job, attempt: int) -> dict[int, float]:
    return dict(StepMetric.objects.filter(job=job, attempt=attempt).values_list("step", "loss"))


def _trainer_events(api, job: Job, kind: str) -> list[dict]:
    lines = api.get(f"/api/v1/jobs/{job.pk}/logs/?limit=1000").json()["lines"]
    found = []
    for line in lines:
        if line["text"].startswith("{"):
            event = json.loads(line["text"])
            if event.get("event") == kind:
                found.append({**event, "attempt": line["attempt"]})
    return found


def _resumed_from(job: Job, checkpoint: Checkpoint) -> JobEvent:
    """The event of the attempt that was offered `checkpoint` to resume from."""
    location = checkpoint.copies.order_by("pk").first().location
    started = (
        JobEvent.objects.filter(job=job, from_state="provisioning", to_state="starting")
        .order_by("at", "pk")
        .last()
    )
    assert "checkpoint offered: " in started.reason and started.reason.endswith(location), (
        started.reason,
        location,
    )
    return started


def _say(capsys, tag: str, text: str) -> None:
    """A line for the closing note, shown whatever pytest captures."""
    with capsys.disabled():
        print(f"\n[{tag}] {text}")


# --- the tests ----------------------------------------------------------------------------------


def test_a_preempted_trainer_job_stops_checkpoints_and_frees_its_gpus_before_the_urgent_job_starts(
    local_nodes, e2e_team, api_for, capsys
):
    pool = factories.make_owned_pool(slug="e2e-preempt")
    nodes = local_nodes(pool, count=NODES, gpus=SLOTS)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    spec = tiny_trainer_spec(
        e2e_team, nodes=NODES, gpus_per_node=SLOTS, steps=STEPS, checkpoint_every_steps=EVERY
    )
    victim = _submitted(api, {**spec, "name": "low-victim", "priority": "low"})
    _dispatched(victim)
    processes = wait_for(
        "the victim's torchrun and workers on both nodes",
        lambda: _processes(victim, 1),
        timeout_s=180,
    )
    assert len(processes) == NODES * (1 + SLOTS)
    wait_for(
        f"the victim's checkpoint at step {EVERY}",
        lambda: Checkpoint.objects.filter(job=victim, step=EVERY).exists(),
        timeout_s=180,
    )
    reached = max(_losses(victim, 1), default=0)  # as far as its output has come in

    # The urgent job needs every slot the victim holds.
    urgent = _submit(
        api,
        e2e_team,
        ["python3", "-c", "import time; time.sleep(2); print('urgent work done')"],
        name="urgent",
        priority="urgent",
        resources={"nodes": NODES, "gpus_per_node": SLOTS},
    )
    before = timezone.now()
    report = scheduling_pass()
    after = timezone.now()
    assert report.preempted == 1 and report.placed == 0, report

    # Asked to stop by that pass: PREEMPTING with the scheduler's reason, and every run's
    # stop recorded in it for the agents' next poll (no reconcile has run).
    victim.refresh_from_db()
    reason = f"preempted by a higher-priority job (urgent job {urgent.pk}); checkpoint, then stop"
    assert (victim.state, victim.state_reason) == ("preempting", reason)
    asked = JobEvent.objects.get(job=victim, to_state="preempting")
    assert asked.actor_label == "scheduler" and asked.reason == reason
    runs = list(Run.objects.filter(job=victim, attempt=1).order_by("node_rank"))
    assert len(runs) == NODES
    for run in runs:
        assert run.stop_requested_at is not None, f"run {run.pk} was not asked to stop"
        assert before <= run.stop_requested_at <= after and run.stop_reason == reason
    urgent.refresh_from_db()
    assert urgent.pending_reason == "waiting for 1 preempted job to checkpoint and stop"

    # Passes keep running while the victim checkpoints: none places the urgent job while a
    # process of the victim is alive (any at all of its own user, where jobs run as one).
    isolated = all(Node.objects.get(pk=n.pk).job_isolation == "user" for n in nodes)
    held_back, deadline = 0, time.monotonic() + 180
    while True:
        scheduling_pass()
        urgent.refresh_from_db()
        alive = [p for p in processes if p.alive()]
        if urgent.state != "pending":
            assert not alive, f"job {urgent.pk} placed while the victim's {alive} live"
            if isolated:
                left = isolation.processes_of(isolation.DEFAULT_UID_BASE + victim.pk)
                assert not left, f"job {urgent.pk} placed while the victim's {left} live"
            break
        held_back += bool(alive)
        assert time.monotonic() < deadline, (
            f"job {urgent.pk} not placed: {urgent.pending_reason}; victim "
            f"{Job.objects.get(pk=victim.pk).state}, its processes alive: {alive}"
        )
        time.sleep(0.2)
    assert urgent.state == "admitted"
    assert held_back >= 1  # the victim's processes outlived the pass that preempted it

    # The victim checkpointed where it stopped and is back in the queue to resume.
    victim.refresh_from_db()
    assert victim.state == "pending"
    assert victim.state_reason == "preempted: stopped; back in the queue to resume"
    assert victim.restarts == 0  # a preemption is not a fault of the job or its nodes
    runs = list(Run.objects.filter(job=victim, attempt=1).order_by("node_rank"))
    for run in runs:
        # The trainer's own word: a stop asked for, its checkpoint committed first. (torchrun
        # itself exits 1 on the SIGTERM it was sent; no SIGKILL was needed.)
        said = repr((run.node_rank, run.reason, run.signal, run.evidence, run.status))
        assert run.state == "exited" and run.signal is None, "\n".join(
            [said, *log_texts(api, victim)[-60:]]
        )
        assert run.status["reason"] == "preempted", run.status
    stopped = runs[0].status["step"]
    assert {r.status["step"] for r in runs} == {stopped}
    assert reached <= stopped < STEPS, (reached, stopped)
    at_stop = wait_for(
        f"the checkpoint at step {stopped} to be registered",
        lambda: Checkpoint.objects.filter(job=victim, attempt=1, step=stopped).first(),
        timeout_s=60,
    )
    assert at_stop.world_size == NODES * SLOTS
    assert not [t for t in log_texts(api, victim) if "did not stop within the grace" in t]

    # Its GPUs were let go only once its runs had ended, as the agents saw them end, and
    # the urgent job got the same GPUs after that.
    spans = ledger_spans(nodes)
    victim_spans = [s for s in spans if s.job == victim.pk]
    assert len(victim_spans) == NODES
    gone = max(s.ended for s in victim_spans)
    released = list(Allocation.objects.filter(job=victim))
    assert len(released) == NODES
    for allocation in released:
        assert allocation.ended_at is not None
        assert allocation.ended_at >= max(r.ended_at for r in runs)
        assert allocation.ended_at.timestamp() >= gone
    given = list(Allocation.objects.filter(job=urgent, ended_at__isnull=True))
    assert {a.node_id for a in given} == {a.node_id for a in released}
    assert {a.gpu_slots for a in given} == {ALL_SLOTS}
    assert min(a.started_at for a in given) >= max(a.ended_at for a in released)

    assert dispatch_one(urgent.pk) == "dispatched"
    urgent = _finished(urgent, timeout_s=120)
    assert urgent.state == "succeeded", urgent.state_reason
    urgent_spans = [s for s in ledger_spans(nodes) if s.job == urgent.pk]
    assert len(urgent_spans) == NODES
    started = min(s.started for s in urgent_spans)
    first_run = Run.objects.filter(job=urgent).order_by("started_at").first()
    asked_at = asked.at.timestamp()
    # Each agent notes the stop in the run's output when its poll brings it.
    notes = LogLine.objects.filter(run__in=runs, text__startswith="stopping: preempted")
    wait_for("the agents' notes of the stop", lambda: notes.count() == NODES)
    saw = max(note.at.timestamp() for note in notes)
    checkpointed = max(run.status["time"] for run in runs)  # the trainers' last word
    _say(
        capsys,
        "preemption",
        f"victim job {victim.pk} ({NODES} local nodes x {SLOTS} slots), preempted after its "
        f"checkpoint at step {EVERY}, stopped at step {stopped}. Asked (PREEMPTING) -> both "
        f"agents saw the stop {saw - asked_at:.2f} s -> checkpoint committed and trainers "
        f"done {checkpointed - asked_at:.2f} s -> processes gone {gone - asked_at:.2f} s "
        f"(agents' ledgers) -> urgent job {urgent.pk} started {started - asked_at:.2f} s "
        f"(ledgers; its first run's started_at {first_run.started_at.timestamp() - asked_at:.2f}"
        f" s); {held_back} passes held it back while the victim's processes lived",
    )

    # Once the urgent job is done, the victim is placed again and resumes from the
    # checkpoint it took when it stopped (its newest), to its last step.
    _dispatched(victim)
    _resumed_from(victim, at_stop)
    victim = _finished(victim)
    assert victim.state == "succeeded", (victim.state_reason, log_texts(api, victim)[-20:])
    (resume,) = _trainer_events(api, victim, "resume")
    assert resume["step"] == stopped and resume["attempt"] == 2
    again = _losses(victim, 2)
    assert min(again) == stopped + 1 and max(again) == STEPS
    assert again[STEPS] < _losses(victim, 1)[1]
    running = (victim.finished_at - victim.submitted_at).total_seconds()
    _say(
        capsys,
        "preemption",
        f"victim job {victim.pk} resumed at step {stopped} and finished {STEPS} steps: "
        f"submitted -> succeeded {running:.1f} s, preempted once",
    )

    # What each node's agent recorded: the victim, the urgent job, the victim again, on the
    # same two slots of each node, never two at once.
    spans = ledger_spans(nodes)
    assert len(spans) == 3 * NODES
    assert assert_no_slot_held_twice(spans) == 3 * NODES  # 3 runs on each node, pairwise


def _committed_on_disk(job: Job) -> list[int]:
    """The steps of the checkpoints committed on storage (a manifest makes one)."""
    return sorted(
        json.loads((p / "manifest.json").read_text())["step"]
        for p in Path(checkpoint_dir(job)).glob("step-*")
        if (p / "manifest.json").is_file()
    )


def test_a_job_that_loses_one_of_its_two_nodes_resumes_on_the_other_resharded(
    local_nodes, e2e_team, api_for, settings, capsys
):
    settings.NODE_SUSPECT_AFTER_S = 2
    settings.NODE_DOWN_AFTER_S = 5
    pool = factories.make_owned_pool(slug="e2e-shrink")
    nodes = local_nodes(pool, count=NODES, gpus=SLOTS)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    spec = tiny_trainer_spec(
        e2e_team, nodes=NODES, gpus_per_node=SLOTS, steps=STEPS, checkpoint_every_steps=EVERY
    )
    spec["resources"]["min_nodes"] = 1
    job = _submitted(api, {**spec, "name": "shrinks", "restart_limit": 3})
    _dispatched(job)
    wait_for("the job's workers on both nodes", lambda: _processes(job, 1), timeout_s=180)
    wait_for(
        "a committed checkpoint",
        lambda: Checkpoint.objects.filter(job=job).exists(),
        timeout_s=180,
    )

    # The machine of node rank 1 is gone: its torchrun, the workers it started (each in a
    # session of its own, so not in torchrun's process group) and its agent.
    lost_run = Run.objects.get(job=job, attempt=1, node_rank=1)
    lost, kept = lost_run.node, Run.objects.get(job=job, attempt=1, node_rank=0).node
    workers = workers_of(lost_run.pid)
    assert len(workers) == SLOTS
    for pid in (lost_run.pid, *(w.pid for w in workers)):
        os.killpg(pid, signal.SIGKILL)
    os.killpg(_agent_pid(lost), signal.SIGKILL)
    killed_at = time.time()
    wait_for(
        "the node to be declared down and the job requeued",
        lambda: (
            heartbeat_sweep() is not None
            and _node_state(lost) == "down"
            and Job.objects.get(pk=job.pk).state == "pending"
        ),
        timeout_s=90,
        every_s=1.0,
    )
    job.refresh_from_db()
    assert job.restarts == 1
    requeued = (
        JobEvent.objects.filter(job=job, to_state="pending")
        .exclude(from_state="pending")
        .order_by("at", "pk")
        .last()
    )
    assert requeued.reason.startswith("requeued:"), requeued.reason
    if "lost its peers (collective timeout)" in requeued.reason:
        # The surviving rank ended first; the timeline names the rank really lost after.
        lost_note = f"attempt 1: rank 1 on {lost.name} was lost: node lost"
        assert job.events.filter(from_state="pending", reason=lost_note).exists()
    down = NodeEvent.objects.filter(node=lost, to_state="down").latest("at")
    assert Run.objects.get(pk=lost_run.pk).state == "lost"
    assert not job.allocations.filter(node=lost, ended_at__isnull=True).exists()
    # The surviving rank, if it has not ended by itself (its peers gone), is asked to stop;
    # its node's GPUs go to the next attempt once its processes are gone.
    survivor = Run.objects.get(job=job, attempt=1, node=kept)
    assert survivor.state != "running" or survivor.stop_requested_at is not None
    wait_for(
        "the surviving rank to end and its GPUs to be let go",
        lambda: not job.allocations.filter(ended_at__isnull=True).exists(),
        timeout_s=60,
    )
    survivor.refresh_from_db()
    # Read storage only now: a rename under way when the kill landed still completes.
    newest = max(_committed_on_disk(job))
    reached = max(_losses(job, 1), default=0)
    assert newest >= reached - EVERY
    assert reached < STEPS, f"the job reached step {reached} of {STEPS} before the kill"

    _dispatched(job)
    (again,) = Run.objects.filter(job=job, attempt=2)
    assert again.node_id == kept.pk
    assert "--nnodes=1" in again.plan["argv"] and f"--nproc-per-node={SLOTS}" in again.plan["argv"]
    resumed_from = Checkpoint.objects.get(job=job, step=newest, attempt=1)
    started = _resumed_from(job, resumed_from)
    assert "1 of 2 nodes" in started.reason, started.reason
    job = _finished(job)
    assert job.state == "succeeded", (job.state_reason, log_texts(api, job)[-20:])

    (resume,) = _trainer_events(api, job, "resume")
    assert resume["step"] == newest and resume["attempt"] == 2
    (start,) = [e for e in _trainer_events(api, job, "start") if e["attempt"] == 2]
    assert start["world_size"] == SLOTS  # resharded: 2 ranks where there were 4
    assert resumed_from.world_size == NODES * SLOTS
    assert Checkpoint.objects.get(pk=resumed_from.pk).state == "verified"
    losses = _losses(job, 2)
    assert min(losses) == newest + 1 and max(losses) == STEPS
    assert losses[STEPS] < _losses(job, 1)[1]

    # The kept node's two attempts, one after the other; the lost node's run never ended
    # in its agent's eyes, and nothing ran there after it.
    assert assert_no_slot_held_twice(ledger_spans(nodes)) == 1
    running = (job.finished_at - job.submitted_at).total_seconds()
    status = (survivor.status or {}).get("reason")
    how = f"{status}, exit {survivor.exit_code}, signal {survivor.signal}"
    _say(
        capsys,
        "resume",
        f"job {job.pk}: node {lost.name} (agent and processes) killed at step ~{reached}; "
        f"job requeued {requeued.at.timestamp() - killed_at:.1f} s later ({requeued.reason!r}), "
        f"node down {down.at.timestamp() - killed_at:.1f} s, the surviving rank gone "
        f"{survivor.ended_at.timestamp() - killed_at:.1f} s ({how}); resumed from step "
        f"{newest} on 1 node x {SLOTS} slots (world {SLOTS}; it was {NODES} nodes x {SLOTS}, "
        f"world {NODES * SLOTS}): {started.reason!r}; all {STEPS} steps done, submitted -> "
        f"succeeded {running:.1f} s",
    )
