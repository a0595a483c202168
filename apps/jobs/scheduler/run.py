"""One scheduling pass: read the snapshot, plan, apply. Called by the `jobs.schedule` task."""

import contextlib
import gc
import time
from dataclasses import dataclass

from django.utils import timezone

from apps.jobs.models.jobs import QUEUE_ORDER_KEY
from apps.jobs.scheduler.apply import decisions_apply
from apps.jobs.scheduler.plan import plan
from apps.jobs.scheduler.read import read_snapshot
from controlplane.cache import best_effort


@dataclass
class PassReport:
    pending: int
    placed: int
    skipped: int
    preempted: int
    bursts: int
    reasons_written: int
    read_ms: float
    plan_ms: float
    apply_ms: float  # the writes, to the pass's commit


@contextlib.contextmanager
def _collector_paused():
    """Pause Python's cycle collector for the pass: the pass makes a few hundred thousand
    short-lived objects, each of which counts toward the next collection, and those
    collections walk the whole heap (a tenth of a pass's read). What the pass leaves
    behind is collected when it ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def scheduling_pass() -> PassReport:
    with _collector_paused():
        # The snapshot and the decisions are dropped before the collector resumes: its
        # first collection then walks what the pass keeps, not everything it made.
        report, queue = _read_plan_apply()
    # Queue positions for the API and pages, without writing 50,000 rows a pass.
    best_effort.set(QUEUE_ORDER_KEY, queue, timeout=3600)
    return report


def _read_plan_apply() -> tuple[PassReport, list[int]]:
    from apps.jobs.services import budget_left

    started = time.perf_counter()
    snapshot, ctx = read_snapshot(now=timezone.now(), budget_left=budget_left)
    read_done = time.perf_counter()
    decisions = plan(snapshot)
    plan_done = time.perf_counter()
    applied = decisions_apply(decisions, ctx)
    done = time.perf_counter()
    placed = set(applied.placed)
    queue = [j for j in decisions.order if j not in placed]
    report = PassReport(
        pending=len(snapshot.pending),
        placed=len(applied.placed),
        skipped=len(applied.skipped),
        preempted=len(applied.preempted),
        bursts=len(decisions.bursts),
        reasons_written=applied.reasons_written,
        read_ms=(read_done - started) * 1000,
        plan_ms=(plan_done - read_done) * 1000,
        apply_ms=(done - plan_done) * 1000,
    )
    return report, queue
