"""What the drills read from the database, and the promises every drill checks after it:
nothing stuck, the usage ledger equal to the GPUs held, no node booked beyond its GPUs."""

import datetime as dt
import time

from tests.drills.stack import Stack
from tests.procs import wait_for

FINISHED = ("succeeded", "failed", "cancelled")


def node_state(stack: Stack, node_id: int) -> str:
    return stack.sql("SELECT state FROM fleet_node WHERE id = %s", node_id)[0][0]


def job(stack: Stack, job_id: int) -> dict:
    row = stack.sql("SELECT state, state_reason, restarts FROM jobs_job WHERE id = %s", job_id)[0]
    return {"state": row[0], "reason": row[1], "restarts": row[2]}


def events(stack: Stack, job_id: int) -> list[tuple[str, str, str]]:
    return stack.sql(
        "SELECT from_state, to_state, reason FROM jobs_jobevent WHERE job_id = %s ORDER BY id",
        job_id,
    )


def runs(stack: Stack, job_id: int) -> list[dict]:
    rows = stack.sql(
        "SELECT id, attempt, node_id, node_rank, state, exit_code, signal, reason, pid "
        "FROM jobs_run WHERE job_id = %s ORDER BY attempt, node_rank",
        job_id,
    )
    keys = ("id", "attempt", "node", "rank", "state", "exit_code", "signal", "reason", "pid")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def finished(stack: Stack, job_id: int, timeout_s: float = 240) -> dict:
    """Wait for the job to end; its row when it has (what it was doing, if it did not)."""
    try:
        wait_for(
            f"job {job_id} to finish",
            lambda: job(stack, job_id)["state"] in FINISHED,
            timeout_s=timeout_s,
            every_s=0.5,
        )
    except AssertionError as error:
        raise AssertionError(f"{error}: {job(stack, job_id)}; {events(stack, job_id)}") from None
    return job(stack, job_id)


def in_state(stack: Stack, job_id: int, *states: str, timeout_s: float = 120) -> float:
    """Wait for the job to reach one of `states`; the monotonic time it was seen there."""
    wait_for(
        f"job {job_id} to be {'/'.join(states)}",
        lambda: job(stack, job_id)["state"] in states,
        timeout_s=timeout_s,
        every_s=0.2,
    )
    return time.monotonic()


def nothing_stuck(stack: Stack) -> None:
    """Every job has ended (each drill waits for its own), with no run or GPUs still held."""
    waiting = stack.sql("SELECT id, state FROM jobs_job WHERE state <> ALL(%s)", list(FINISHED))
    assert not waiting, f"jobs not finished: {waiting}"
    open_runs = stack.sql(
        "SELECT r.id, r.job_id, r.state FROM jobs_run r WHERE r.state IN ('planned', 'running')"
    )
    assert not open_runs, f"runs still open on finished jobs: {open_runs}"
    wait_for(
        "every allocation to be released",
        lambda: not stack.sql("SELECT id FROM jobs_allocation WHERE ended_at IS NULL"),
        timeout_s=30,
    )


def cancel_unfinished(stack: Stack) -> None:
    for (job_id,) in stack.sql("SELECT id FROM jobs_job WHERE state <> ALL(%s)", list(FINISHED)):
        stack.api("POST", f"/api/v1/jobs/{job_id}/cancel/", {"reason": "the drill failed"})
    wait_for(
        "the failed drill's jobs to end",
        lambda: not stack.sql("SELECT 1 FROM jobs_job WHERE state <> ALL(%s)", list(FINISHED)),
        timeout_s=60,
    )


def ledger_balances(stack: Stack, timeout_s: float = 60) -> None:
    """Each job's metered GPU-seconds equal its allocations' (GPUs × time held)."""

    def difference() -> list:
        held = dict(
            stack.sql(
                "SELECT job_id, SUM(gpus * EXTRACT(EPOCH FROM ended_at - started_at)) "
                "FROM jobs_allocation GROUP BY job_id"
            )
        )
        metered = dict(
            stack.sql(
                'SELECT job_id, SUM(gpus * EXTRACT(EPOCH FROM "end" - start)) '
                "FROM costs_usageentry WHERE kind = 'job' AND corrects_id IS NULL "
                "GROUP BY job_id"
            )
        )
        return [
            (job_id, float(seconds), float(metered.get(job_id) or 0))
            for job_id, seconds in held.items()
            if abs(float(seconds) - float(metered.get(job_id) or 0)) > 0.01
        ]

    try:
        wait_for("the meter to reach every allocation", lambda: not difference(), timeout_s)
    except AssertionError:
        raise AssertionError(f"ledger ≠ allocations (job, held, metered): {difference()}") from None


def no_node_overbooked(stack: Stack) -> None:
    """No two allocations held at once on a node share a GPU, and none holds more GPUs
    than the node has."""
    overlapping = stack.sql(
        "SELECT a.id, b.id, a.node_id FROM jobs_allocation a JOIN jobs_allocation b "
        "ON a.node_id = b.node_id AND a.id < b.id "
        "AND a.started_at < COALESCE(b.ended_at, 'infinity') "
        "AND b.started_at < COALESCE(a.ended_at, 'infinity') "
        "WHERE (a.gpu_slots & b.gpu_slots) <> 0"
    )
    assert not overlapping, f"allocations sharing GPUs: {overlapping}"
    beyond = stack.sql(
        "SELECT a.id, a.node_id, SUM(b.gpus), n.gpu_count FROM jobs_allocation a "
        "JOIN jobs_allocation b ON a.node_id = b.node_id "
        "AND b.started_at <= a.started_at AND a.started_at < COALESCE(b.ended_at, 'infinity') "
        "JOIN fleet_node n ON n.id = a.node_id "
        "GROUP BY a.id, a.node_id, n.gpu_count HAVING SUM(b.gpus) > n.gpu_count"
    )
    assert not beyond, f"nodes booked beyond their GPUs (allocation, node, held, has): {beyond}"


def seconds_between(first: dt.datetime, second: dt.datetime) -> float:
    return (second - first).total_seconds()
