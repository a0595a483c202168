"""The planner alone at the design size: `plan()` over 10,000 nodes and 50,000 pending jobs.

No database and no Django: a synthetic snapshot (seeded, so every run plans the same
queue) of 10,000 nodes × 8 GPUs in 1,250 racks of 8 (four owned pools and one cloud
pool), 50,000 pending jobs from 1,000 teams (1 to 512 GPUs, every priority class,
quotas for every team), a maintenance window and a team reservation.

It times the first pass over the empty fleet (placements_per_s = jobs placed ÷ that
pass's planning time), then steady passes: the placements so far become running jobs,
1% of the running jobs finish, preempted jobs return to the queue, and the next pass
plans (plan_ms = the median of five). Only `plan()` is timed, not building snapshots.

Run: `.venv/bin/python -m bench.scheduler_plan`. Last line: `scheduler_plan:
plan_ms=<median steady> first_pass_ms=<n> placements_per_s=<n> jobs=50000 nodes=10000`.
"""

import os
import platform
import random
import statistics
import sys
import time

from apps.jobs.scheduler.plan import plan
from apps.jobs.scheduler.snapshot import (
    ANY_GPU,
    CLOUD,
    OWNED,
    OWNED_THEN_CLOUD,
    NodeSlot,
    Pending,
    PoolInfo,
    Quota,
    Running,
    Snapshot,
    Window,
)

SEED = int(os.environ.get("BENCH_SEED", "20261201"))
RACKS = 1250
NODES_PER_RACK = 8
GPUS = 8
TEAMS = 1000
JOBS = int(os.environ.get("BENCH_JOBS", "50000"))
STEADY_PASSES = 5
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
NOW = 1_796_126_400.0  # 2026-12-01 12:00 UTC

POOLS = {
    1: PoolInfo(id=1, kind="owned", gpu_type="H100", spot=False, enabled=True),
    2: PoolInfo(id=2, kind="owned", gpu_type="H100", spot=False, enabled=True),
    3: PoolInfo(id=3, kind="owned", gpu_type="H200", spot=False, enabled=True),
    4: PoolInfo(id=4, kind="owned", gpu_type="A100", spot=False, enabled=True),
    5: PoolInfo(
        id=5,
        kind="cloud",
        gpu_type="H100",
        spot=True,
        enabled=True,
        burst_delay_s=600,
        max_nodes=600,
    ),
}


def rack_pool(rack: int) -> int:
    """Racks 0-1199 are owned (300 per pool); racks 1200-1249 are the cloud pool's nodes."""
    return 1 + rack // 300 if rack < 1200 else 5


def build_fleet() -> dict[int, tuple[int, int]]:
    """node id -> (pool id, rack id)."""
    return {
        rack * NODES_PER_RACK + i + 1: (rack_pool(rack), rack + 1)
        for rack in range(RACKS)
        for i in range(NODES_PER_RACK)
    }


def build_queue(rng: random.Random) -> list[Pending]:
    jobs = []
    for job_id in range(1, JOBS + 1):
        size = rng.choice(SIZES)
        nodes, per_node = (1, size) if size < GPUS else (size // GPUS, GPUS)
        gpu_type = rng.choices(("H100", "H200", "A100", ANY_GPU), weights=(50, 20, 15, 15))[0]
        placement = rng.choices((OWNED, OWNED_THEN_CLOUD, CLOUD), weights=(50, 40, 10))[0]
        if placement == CLOUD and gpu_type not in ("H100", ANY_GPU):
            placement = OWNED_THEN_CLOUD  # the cloud pool is H100: submission would refuse it
        jobs.append(
            Pending(
                job_id=job_id,
                team_id=rng.randint(1, TEAMS),
                priority=rng.choices((0, 1, 2, 3), weights=(25, 45, 20, 10))[0],
                queued_at=NOW - rng.uniform(0, 3 * 86400),
                gpu_type=gpu_type,
                nodes=nodes,
                gpus_per_node=per_node,
                placement=placement,
                spot_allowed=rng.random() < 0.7,
                time_limit_s=rng.choice((1, 2, 4, 8, 12, 24, 48)) * 3600,
                budget_ok=rng.random() < 0.95,
            )
        )
    return jobs


def snapshot_of(fleet, now, running: dict[int, Running], pending, extras) -> Snapshot:
    held: dict[int, int] = {}
    for r in running.values():
        for node_id, gpus in r.node_gpus:
            held[node_id] = held.get(node_id, 0) + gpus
    nodes = tuple(
        NodeSlot(
            id=node_id,
            pool_id=pool_id,
            rack_id=rack_id,
            gpus_total=GPUS,
            gpus_free=GPUS - held.get(node_id, 0),
            schedulable=node_id % 997 != 0,  # a few drained or down nodes
        )
        for node_id, (pool_id, rack_id) in fleet.items()
    )
    return Snapshot(
        now=now,
        nodes=nodes,
        pools=POOLS,
        running=tuple(running.values()),
        pending=tuple(pending),
        **extras,
    )


def extras_for(rng: random.Random) -> dict:
    # Nominal quotas add up to about the fleet (as in one Kueue cohort); any team may
    # borrow what others leave idle up to 512 GPUs of a type, so every job can run.
    quotas = {}
    for team in range(1, TEAMS + 1):
        for gpu_type, choices in (
            ("H100", (16, 32, 64, 128)),
            ("H200", (8, 16, 24, 32)),
            ("A100", (8, 16, 24, 32)),
        ):
            nominal = rng.choice(choices)
            quotas[(team, gpu_type)] = Quota(nominal=nominal, borrow=512 - nominal)
    usage = {team: rng.expovariate(1 / 3.6e6) for team in range(1, TEAMS + 1)}
    shares = {team: float(rng.randint(1, 4)) for team in range(1, TEAMS + 1)}
    windows = (
        # Maintenance of two racks of pool 1 this afternoon.
        Window(
            id=1,
            node_ids=frozenset(range(41, 57)),
            team_id=None,
            start=NOW + 2 * 3600,
            end=NOW + 6 * 3600,
        ),
        # Team 7's deadline: one rack of pool 2 for a day.
        Window(
            id=2,
            node_ids=frozenset(range(2401, 2409)),
            team_id=7,
            start=NOW - 3600,
            end=NOW + 86400,
        ),
    )
    return {"quotas": quotas, "usage": usage, "shares": shares, "windows": windows}


def timed(snapshot: Snapshot):
    started = time.perf_counter()
    decisions = plan(snapshot)
    return decisions, (time.perf_counter() - started) * 1000


def advance(decisions, *, running, pending, queue, rng, now) -> None:
    """Apply a pass: placements run, victims go back to the queue, 1% of running finish."""
    for p in decisions.placements:
        job = pending.pop(p.job_id)
        running[p.job_id] = Running(
            job_id=job.job_id,
            team_id=job.team_id,
            gpu_type=POOLS[p.pool_id].gpu_type,
            priority=job.priority,
            pool_id=p.pool_id,
            node_gpus=p.node_gpus,
            expected_end=now + job.time_limit_s,
        )
    for pre in decisions.preemptions:
        if running.pop(pre.job_id, None) is not None:
            pending[pre.job_id] = queue[pre.job_id]  # keeps its queued_at, so its place
    for job_id in rng.sample(sorted(running), len(running) // 100):
        del running[job_id]


def main() -> None:
    rng = random.Random(SEED)
    fleet = build_fleet()
    queue = {j.job_id: j for j in build_queue(rng)}
    extras = extras_for(rng)
    pending = dict(queue)
    running: dict[int, Running] = {}
    now = NOW

    snapshot = snapshot_of(fleet, now, running, pending.values(), extras)
    decisions, first_ms = timed(snapshot)
    placed = len(decisions.placements)
    gpus_placed = sum(g for p in decisions.placements for _, g in p.node_gpus)
    schedulable = sum(n.gpus_total for n in snapshot.nodes if n.schedulable)
    print(
        f"first pass: {first_ms:.0f} ms, {placed} placed ({gpus_placed} of {schedulable} "
        f"schedulable GPUs), {len(decisions.waits)} waiting, {len(decisions.bursts)} bursts, "
        f"{sum(1 for p in decisions.placements if p.backfilled)} backfilled"
    )
    steady = []
    for i in range(STEADY_PASSES):
        advance(decisions, running=running, pending=pending, queue=queue, rng=rng, now=now)
        now += 60
        snapshot = snapshot_of(fleet, now, running, pending.values(), extras)
        decisions, ms = timed(snapshot)
        steady.append(ms)
        print(
            f"steady pass {i + 1}: {ms:.0f} ms, {len(snapshot.running)} running, "
            f"{len(snapshot.pending)} pending, {len(decisions.placements)} placed "
            f"({sum(1 for p in decisions.placements if p.backfilled)} backfilled), "
            f"{len(decisions.preemptions)} preemptions, {len(decisions.bursts)} bursts, "
            f"{sum(1 for w in decisions.waits.values() if w.estimated_start is not None)} "
            f"with an estimated start"
        )
    plan_ms = statistics.median(steady)
    per_s = placed / (first_ms / 1000) if first_ms else 0.0
    print(
        f"{time.strftime('%Y-%m-%d')}, python {platform.python_version()} "
        f"({platform.python_implementation()}) on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"seed {SEED}, command: python -m bench.scheduler_plan"
    )
    print(
        f"scheduler_plan: plan_ms={plan_ms:.0f} first_pass_ms={first_ms:.0f} "
        f"placements_per_s={per_s:.0f} jobs={len(queue)} nodes={len(fleet)}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
