"""The whole scheduling pass at design size, on the database: read, plan, write.

10,000 nodes × 8 GPUs in 1,250 racks, 50,000 pending jobs from 1,000 teams
(1 to 512 GPUs, every priority class, quotas set). Times the first pass over the
empty fleet (placements_per_s = jobs placed ÷ that pass's time, read and write
included), then ten steady passes (BENCH_PASSES) with 1% of the running jobs
finishing between passes (pass_ms = their median). Goal: pass_ms ≤ 1000 and
placements_per_s ≥ 5000. Run with DATABASE_URL set to measure on PostgreSQL.

The passes run as in a Celery worker that is up (worker_warm_up): the cache and
the broker have been reached before the clock starts, as a worker reaches them
at start-up, so the first pass does not pay for importing their client
libraries and connecting (about 80 ms here).

Last line: `scheduler: pass_ms=<n> placements_per_s=<n> jobs=<n> nodes=<n>`.
"""

import datetime as dt
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.db import connection  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import interpreter_ms  # noqa: E402

NODES = int(os.environ.get("BENCH_NODES", "10000"))
JOBS = int(os.environ.get("BENCH_JOBS", "50000"))
TEAMS = int(os.environ.get("BENCH_TEAMS", "1000"))
# Ten: the running set takes several passes to settle (borrowing and preemption build up),
# and five hid a planner that slowed down pass after pass (bench/RESULTS.md).
STEADY_PASSES = int(os.environ.get("BENCH_PASSES", "10"))
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
SIZE_WEIGHTS = [20, 10, 10, 25, 12, 10, 6, 4, 2, 1]
PRIORITIES = ["low", "normal", "high", "urgent"]


def build(rng: random.Random) -> None:
    from apps.accounts.models import Team, TeamQuota
    from apps.fleet.models import Node, NodePool, Rack, Site
    from apps.jobs.models import Job

    site = Site.objects.create(name="bench", slug="bench")
    pools = [
        NodePool.objects.create(
            name=f"bench-{i}",
            slug=f"bench-{i}",
            kind="owned",
            gpu_type="H100",
            site=site,
            max_nodes=NODES,
        )
        for i in range(4)
    ]
    racks = Rack.objects.bulk_create(
        [Rack(site=site, name=f"r{i:04d}", power_budget_kw=80) for i in range(NODES // 8)]
    )
    Node.objects.bulk_create(
        [
            Node(
                name=f"n{i:05d}",
                pool=pools[(i // 8) % len(pools)],
                rack=racks[i // 8],
                rack_unit=1 + (i % 8) * 4,
                provider="local",
                capacity_type="owned",
                gpu_type="H100",
                gpu_count=8,
                state="ready",
            )
            for i in range(NODES)
        ],
        batch_size=2000,
    )
    teams = Team.objects.bulk_create(
        [Team(name=f"team {i}", slug=f"team-{i}") for i in range(TEAMS)], batch_size=2000
    )
    TeamQuota.objects.bulk_create(
        [
            TeamQuota(
                team=t,
                gpu_type="H100",
                max_gpus=rng.choice([64, 128, 256, 512]),
                borrow_gpus=rng.choice([0, 64, 256]),
            )
            for t in teams
        ],
        batch_size=2000,
    )
    now = timezone.now()
    jobs = []
    for i in range(JOBS):
        gpus = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        nodes, per_node = (gpus // 8, 8) if gpus >= 8 else (1, gpus)
        jobs.append(
            Job(
                name=f"job-{i}",
                team=teams[rng.randrange(TEAMS)],
                kind="command",
                spec={},
                priority_class=rng.choice(PRIORITIES),
                gpu_type="H100",
                nodes=nodes,
                gpus_per_node=per_node,
                dp_shard=gpus,
                placement="owned",
                time_limit_s=rng.choice([3600, 4 * 3600, 12 * 3600, 48 * 3600]),
                queued_at=now - dt.timedelta(seconds=rng.randrange(7 * 86400)),
            )
        )
    Job.objects.bulk_create(jobs, batch_size=5000)


def finish_some(rng: random.Random, fraction: float) -> int:
    from apps.jobs.models import Job, JobState
    from apps.jobs.transitions import allocations_release

    running = list(Job.objects.filter(state=JobState.ADMITTED).values_list("id", flat=True))
    done = rng.sample(running, max(1, int(len(running) * fraction))) if running else []
    Job.objects.filter(pk__in=done).update(state=JobState.SUCCEEDED, finished_at=timezone.now())
    allocations_release(job_ids=done, now=timezone.now())
    return len(done)


def worker_warm_up() -> None:
    """What a Celery worker that runs passes has done before its first one: reached the
    cache and the broker (their client libraries imported, a connection in the producer
    pool that publishes the dispatch messages, a message sent) and loaded its result
    backend. The build has already made the database connection."""
    from django.core.cache import cache

    from controlplane.celery import app

    cache.get("bench:warm-up")
    # A worker's producer pool holds a broker connection once it has sent anything, and
    # its result backend is loaded when it first runs a task.
    app.backend  # noqa: B018 (loads the backend)
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=1)
    # A worker that has run passes has sent dispatch messages before: its first one pays
    # once for declaring the queue and Celery's first-message set-up (about 10 ms here).
    # A dispatch of no jobs does nothing when a worker takes it.
    app.send_task("jobs.dispatch", args=[[]])


def main() -> None:
    from apps.jobs.scheduler.run import scheduling_pass

    rng = random.Random(20261201)
    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    try:
        started = time.perf_counter()
        build(rng)
        print(
            f"built {NODES} nodes, {JOBS} jobs, {TEAMS} teams in "
            f"{time.perf_counter() - started:.1f}s",
            flush=True,
        )
        worker_warm_up()
        speed = interpreter_ms()
        first_started = time.perf_counter()
        first = scheduling_pass()
        first_s = time.perf_counter() - first_started
        print(
            f"first pass: {first.placed} placed in {first_s * 1000:.0f} ms "
            f"(read {first.read_ms:.0f}, plan {first.plan_ms:.0f}, "
            f"write after it {first.apply_ms:.0f})",
            flush=True,
        )
        steady = []
        for _ in range(STEADY_PASSES):
            finished = finish_some(rng, 0.01)
            began = time.perf_counter()
            report = scheduling_pass()
            steady.append((time.perf_counter() - began) * 1000)
            print(
                f"steady pass: {finished} finished, {report.placed} placed, "
                f"{report.reasons_written} reasons written, {steady[-1]:.0f} ms "
                f"(read {report.read_ms:.0f}, plan {report.plan_ms:.0f}, "
                f"write after it {report.apply_ms:.0f})",
                flush=True,
            )
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(
        f"python {platform.python_version()}, database {connection.vendor}, {os.cpu_count()} "
        f"CPUs, sum(range(10**6)) in {speed:.1f} ms"
    )
    print(
        f"scheduler: pass_ms={statistics.median(steady):.0f} "
        f"placements_per_s={first.placed / first_s:.0f} jobs={JOBS} nodes={NODES}"
    )


if __name__ == "__main__":
    sys.exit(main())
