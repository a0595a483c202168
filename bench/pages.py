"""Every page and live fragment at design size, on PostgreSQL: server time and queries.

Seeds a scratch database with BENCH_NODES (10,000) 8-GPU nodes in racks, pools and sites
(bench/costs.py's fleet), BENCH_JOBS (100,000) jobs of 1,000 teams in every state (most
finished; a few thousand pending, held or running, the running ones with allocations and
runs), their events, a month of the cost ledger (BENCH_ROWS rows, as bench/costs.py loads
it, with its daily roll-ups), and for one running trainer job of the researcher's team
BENCH_LOG_LINES (100,000) log lines, a training curve, checkpoints, and a month of its
first node's GPU telemetry. Each seeding step is one function in SEEDS.

Then, for each row of pages() (name, user, url: a new page is one more row), as that
user through django.test.Client: one warm-up request, then BENCH_REPEAT (5) requests; it
prints the median server time (the time around client.get, in this process; a page over
ten times the goal is timed once), the queries of one request (CaptureQueriesContext)
and their time in the database as the driver saw it. Goal (issue 33): every page
≤ 150 ms with a bounded number of queries. BENCH_KEEP=1 keeps the database for the next
run (seeded once) instead of dropping it.

Last line: `pages: worst_ms=<n> worst_page=<name> pages=<n>`.
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
from django.test.utils import CaptureQueriesContext, setup_test_environment  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import copy_objects, costs, interpreter_ms, sequences_reset  # noqa: E402
from bench.scheduler import PRIORITIES, SIZE_WEIGHTS, SIZES  # noqa: E402

JOBS = int(os.environ.get("BENCH_JOBS", "100000"))
NODES = costs.NODES  # BENCH_NODES, 10,000
TEAMS = costs.TEAMS
LEDGER_ROWS = int(os.environ.get("BENCH_ROWS", "3000000"))  # a month at the costs bench's density
LOG_LINES = int(os.environ.get("BENCH_LOG_LINES", "100000"))
STEPS = int(os.environ.get("BENCH_STEPS", "20000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "5"))
KEEP = os.environ.get("BENCH_KEEP") == "1"
GOAL_MS = 150
NOW = timezone.now().replace(microsecond=0)
MONTH = 30  # days of history
# The shares of the jobs that are not finished (the rest succeeded, failed or cancelled).
LIVE = {"pending": 0.03, "held": 0.002, "running": 0.02, "admitted": 0.001}
FINISHED = (("succeeded", 85), ("failed", 10), ("cancelled", 5))


class Seeded:
    """What the seeding made that the pages' table names: users and ids."""

    researcher = ops = finance = None
    big_job_id = 1  # the first job: running, team-0's, with logs, curves and checkpoints
    finished_job_id = 0
    profile_name = ""


def seed_fleet(rng, seeded) -> None:
    """bench/costs.py's fleet in 4 sites (racks for the owned half), every node's 8 GPUs with
    a latest reading, a few nodes drained or down, and the teams."""
    from apps.fleet.models import Gpu, Node, NodeEvent

    pool_ids, node_ids = costs.build_fleet(sites=4)
    seeded.pool_ids, seeded.node_ids = pool_ids, node_ids
    Node.objects.filter(id__in=node_ids[::97]).update(state="drained", state_reason="bench")
    Node.objects.filter(id__in=node_ids[::131]).update(state="down", state_reason="bench")
    Node.objects.update(last_heartbeat_at=NOW, agent_version="1.0.0", nccl_version="2.21.5")
    copy_objects(
        Gpu,
        (
            Gpu(
                id=n * 8 + i + 1,
                node_id=node_id,
                index=i,
                uuid=f"GPU-{node_id:06d}-{i}",
                model="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                health="healthy",
                utilization_pct=rng.random() * 100,
                memory_used_mib=rng.randrange(81559),
                power_w=100 + rng.random() * 600,
                temperature_c=30 + rng.random() * 50,
                ecc_errors=0,
                reported_at=NOW,
            )
            for n, node_id in enumerate(node_ids)
            for i in range(8)
        ),
    )
    copy_objects(
        NodeEvent,
        (
            NodeEvent(
                id=k * len(node_ids) + n + 1,
                node_id=node_id,
                at=NOW - dt.timedelta(days=MONTH - k),
                from_state=from_state,
                to_state=to_state,
                reason="bench",
                actor_label="system",
            )
            for k, (from_state, to_state) in enumerate((("", "pending"), ("pending", "ready")))
            for n, node_id in enumerate(node_ids)
        ),
    )
    sequences_reset(Gpu, NodeEvent)


def seed_people(rng, seeded) -> None:
    """A user per team (its jobs' submitter), a researcher in three teams, ops and finance,
    and a few API tokens and NCCL profiles."""
    from django.contrib.auth import get_user_model

    from apps.accounts import services as accounts
    from apps.accounts.models import Membership, OrgRole, Team, TeamRole

    User = get_user_model()
    teams = list(Team.objects.order_by("id"))
    users = User.objects.bulk_create(
        [User(username=f"user-{t.slug}") for t in teams], batch_size=2000
    )
    Membership.objects.bulk_create(
        [
            Membership(team=t, user=u, role=TeamRole.RESEARCHER)
            for t, u in zip(teams, users, strict=True)
        ],
        batch_size=2000,
    )
    seeded.team_ids = [t.pk for t in teams]
    seeded.user_ids = [u.pk for u in users]
    seeded.researcher = users[0]  # team-0's researcher, in two more teams
    Membership.objects.bulk_create(
        [Membership(team=t, user=users[0], role=TeamRole.RESEARCHER) for t in teams[1:3]]
    )
    seeded.ops = User.objects.create_user(username="bench-ops")
    OrgRole.objects.create(user=seeded.ops, role="ops")
    seeded.finance = User.objects.create_user(username="bench-finance")
    OrgRole.objects.create(user=seeded.finance, role="finance")
    for i in range(5):
        accounts.api_token_create(
            user=seeded.researcher, name=f"ci-{i}", scopes=["read", "submit"], by=seeded.researcher
        )


def _job_state(rng) -> str:
    draw = rng.random()
    for state, share in LIVE.items():
        if draw < share:
            return state
        draw -= share
    return rng.choices([s for s, _ in FINISHED], [w for _, w in FINISHED])[0]


def seed_jobs(rng, seeded) -> None:
    """JOBS jobs over the month, their events, and for the live ones what the scheduler
    writes: wait reasons for the pending, allocations and runs for the running (whole nodes
    of the fleet, in order)."""
    from apps.jobs.models import Allocation, Job, JobEvent, JobWait, Run

    free = list(reversed(seeded.node_ids))
    jobs, events, waits, allocations, runs = [], [], [], [], []
    busy = set()
    for i in range(JOBS):
        job_id = i + 1
        team = i % len(seeded.team_ids)
        state = _job_state(rng)
        if job_id == 1:
            state = "running"  # the Job page's job: team-0's, with logs, curves and checkpoints
        gpus = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        nodes, per_node = (gpus // 8, 8) if gpus >= 8 else (1, gpus)
        if state in ("running", "admitted"):
            nodes, per_node = (2 if job_id == 1 else min(nodes, 4)), 8
            if nodes > len(free):
                state = "pending"  # the fleet is full
        queued = NOW - dt.timedelta(seconds=(JOBS - i) * MONTH * 86400 // JOBS)
        started = queued + dt.timedelta(seconds=rng.randrange(60, 3600))
        finished = started + dt.timedelta(seconds=rng.randrange(60, 12 * 3600))
        done = state in ("succeeded", "failed", "cancelled")
        if state in ("pending", "held"):
            queued = NOW - dt.timedelta(seconds=rng.randrange(3 * 86400))
        kind = "trainer" if i % 5 == 0 else "command"
        jobs.append(
            Job(
                id=job_id,
                name=f"job-{i}",
                team_id=seeded.team_ids[team],
                submitted_by_id=seeded.user_ids[team],
                priority_class=rng.choice(PRIORITIES),
                kind=kind,
                spec={"kind": kind, "command": ["python", "train.py"], "fingerprint": "x"},
                gpu_type="H100",
                nodes=nodes,
                gpus_per_node=per_node,
                dp_shard=nodes * per_node,
                placement="owned",
                time_limit_s=rng.choice([3600, 4 * 3600, 12 * 3600, 48 * 3600]),
                state=state,
                state_reason="exit code 1" if state == "failed" else "",
                state_changed_at=finished if done else started,
                queued_at=queued,
                submitted_at=queued,
                admitted_at=started if state not in ("pending", "held") else None,
                started_at=started if state == "running" or done else None,
                finished_at=finished if done else None,
                pool_id=seeded.pool_ids[0] if state in ("running", "admitted") or done else None,
            )
        )
        path = ["pending"]
        if state == "held":
            path.append("held")
        elif state != "pending":
            path += ["admitted"] + (["running"] if state != "admitted" else [])
            if done:
                path.append(state)
        for k, (before, after) in enumerate(zip(["", *path], path, strict=False)):
            events.append(
                JobEvent(
                    id=len(events) + 1,
                    job_id=job_id,
                    at=[queued, started, started, finished][min(k, 3)],
                    from_state=before,
                    to_state=after,
                    reason="bench",
                    actor_label="scheduler",
                )
            )
        if state == "pending":
            waits.append(JobWait(job_id=job_id, reason="waiting for 8 H100 GPUs in pool bench-0"))
        if state in ("running", "admitted"):
            for rank in range(nodes):
                node_id = free.pop()
                busy.add(node_id)
                allocations.append(
                    Allocation(
                        id=len(allocations) + 1,
                        job_id=job_id,
                        node_id=node_id,
                        gpus=per_node,
                        gpu_slots=(1 << per_node) - 1,
                        started_at=started,
                    )
                )
                runs.append(
                    Run(
                        id=len(runs) + 1,
                        job_id=job_id,
                        node_id=node_id,
                        attempt=1,
                        node_rank=rank,
                        allocation_id=len(allocations),
                        plan={"argv": ["python", "train.py"], "env": {}},
                        state="running" if state == "running" else "planned",
                        created_at=started,
                        started_at=started if state == "running" else None,
                    )
                )
    for model, rows in ((Job, jobs), (JobEvent, events), (JobWait, waits)):
        copy_objects(model, rows)
    copy_objects(Allocation, allocations)
    copy_objects(Run, runs)
    sequences_reset(Job, JobEvent, Allocation, Run)
    from apps.fleet.models import Node

    Node.objects.filter(state="busy").exclude(id__in=busy).update(state="ready")
    pending = [j for j in jobs if j.state == "pending"]
    print(
        f"  {len(jobs):,} jobs ({len(pending):,} pending, {len(runs):,} runs on "
        f"{len(busy):,} nodes), {len(events):,} events",
        flush=True,
    )


def seed_job_output(rng, seeded) -> None:
    """The big job's LOG_LINES log lines over its ranks and STEPS training steps over two
    attempts; 200 lines for a few hundred other jobs."""
    from apps.jobs.models import LogLine, Run, StepMetric

    run_ids = list(Run.objects.filter(job_id=seeded.big_job_id).values_list("id", flat=True))
    others = list(
        Run.objects.exclude(job_id=seeded.big_job_id)
        .filter(node_rank=0)
        .values_list("job_id", "id")[:300]
    )
    started = NOW - dt.timedelta(days=2)

    def lines():
        for k in range(LOG_LINES):
            yield LogLine(
                id=k + 1,
                run_id=run_ids[k % len(run_ids)],
                job_id=seeded.big_job_id,
                seq=k // len(run_ids),
                stream="stdout" if k % 10 else "stderr",
                at=started + dt.timedelta(seconds=k),
                text=f"[rank {k % 8}] step {k // 8}: loss {2.5 - k / (LOG_LINES * 1.5):.4f}",
            )
        for j, (job_id, run_id) in enumerate(others):
            for seq in range(200):
                yield LogLine(
                    id=LOG_LINES + j * 200 + seq + 1,
                    run_id=run_id,
                    job_id=job_id,
                    seq=seq,
                    stream="stdout",
                    at=started + dt.timedelta(seconds=seq),
                    text=f"line {seq}",
                )

    copy_objects(LogLine, lines())
    copy_objects(
        StepMetric,
        (
            StepMetric(
                id=k + 1,
                job_id=seeded.big_job_id,
                attempt=1 + (k >= STEPS // 3),
                step=k if k < STEPS // 3 else k - STEPS // 3 + STEPS // 4,
                at=started + dt.timedelta(seconds=k * 5),
                loss=3.0 / (1 + k / 1000),
                grad_norm=1.0,
                lr=3e-4,
                tokens_per_s=400_000 + rng.random() * 10_000,
                mfu=0.4 + rng.random() * 0.05,
                peak_mem_gib=60.0,
            )
            for k in range(STEPS)
        ),
    )
    sequences_reset(LogLine, StepMetric)


def seed_checkpoints(rng, seeded) -> None:
    """Three checkpoints (with a shared copy each) per finished trainer job, 50 for the big
    job."""
    from apps.checkpoints.models import Checkpoint, CheckpointCopy
    from apps.jobs.models import Job

    trainers = list(
        Job.objects.filter(kind="trainer", state__in=["succeeded", "running"]).values_list(
            "id", "team_id", "started_at"
        )
    )
    checkpoints = []
    for job_id, team_id, started in trainers:
        for k in range(50 if job_id == seeded.big_job_id else 3):
            checkpoints.append(
                Checkpoint(
                    id=len(checkpoints) + 1,
                    job_id=job_id,
                    team_id=team_id,
                    attempt=1,
                    step=(k + 1) * 500,
                    manifest_sha256=f"{job_id:032x}{k:032x}",
                    world_size=8,
                    layout={"dp_replicate": 1, "dp_shard": 8, "tp": 1, "pp": 1},
                    size_bytes=50 * 2**30,
                    files=9,
                    loss=2.0 - k / 100,
                    state="verified",
                    committed_at=started + dt.timedelta(minutes=30 * (k + 1)),
                    registered_at=started + dt.timedelta(minutes=30 * (k + 1)),
                    state_changed_at=started + dt.timedelta(minutes=30 * (k + 1)),
                    verified_at=started + dt.timedelta(minutes=30 * (k + 1)),
                )
            )
    copy_objects(Checkpoint, checkpoints)
    copy_objects(
        CheckpointCopy,
        (
            CheckpointCopy(
                id=c.id,
                checkpoint_id=c.id,
                kind="shared",
                location=f"/shared/ckpt/{c.job_id}/{c.step}",
                state="verified",
                created_at=c.committed_at,
                state_changed_at=c.committed_at,
                verified_at=c.committed_at,
            )
            for c in checkpoints
        ),
    )
    sequences_reset(Checkpoint, CheckpointCopy)
    print(f"  {len(checkpoints):,} checkpoints", flush=True)


def seed_ledger(rng, seeded) -> None:
    """A month of the cost ledger up to today, loaded as bench/costs.py loads it, and its
    daily roll-ups."""
    from apps.costs import services

    costs.ROWS = LEDGER_ROWS
    costs.DAYS = MONTH + 1
    costs.FIRST_DAY = NOW.date() - dt.timedelta(days=MONTH)
    loaded = costs.load(seeded.pool_ids, seeded.node_ids)
    rollups = services.rollups_rebuild()
    print(f"  {loaded:,} ledger rows, {rollups:,} roll-up rows", flush=True)


def publish_queue_order() -> None:
    """What a scheduling pass publishes in the cache for the pages: the pending jobs in
    queue order (here by age) and when it read them. (The cache's keys are this process's:
    tests.settings prefixes them with its id, so a kept database needs them again.)"""
    from apps.jobs.models import Job
    from apps.jobs.models.jobs import LAST_PASS_KEY, QUEUE_ORDER_KEY
    from controlplane.cache import best_effort

    pending = Job.objects.live().filter(state="pending").order_by("queued_at", "id")
    best_effort.set(QUEUE_ORDER_KEY, list(pending.values_list("id", flat=True)), timeout=None)
    best_effort.set(LAST_PASS_KEY, time.time(), timeout=None)


def seed_telemetry(rng, seeded) -> None:
    """GPU telemetry of the node page's node (the Job page's job's first): a month of minute
    means and a day of raw samples every 10 s, for its 8 GPUs. (A month of minutes for the
    whole fleet would be 3.5 billion rows: the node page reads one node's.)"""
    from apps.fleet.models import GpuMinute, GpuSample
    from apps.jobs.models import Run

    node_id = Run.objects.filter(job_id=seeded.big_job_id, node_rank=0).values("node_id")[0]
    node_id = node_id["node_id"]
    start = NOW.replace(second=0) - dt.timedelta(days=MONTH)

    def readings(model, first, step_s: int, count: int):
        for k in range(count):
            at = first + dt.timedelta(seconds=k * step_s)
            for gpu in range(8):
                yield model(
                    node_id=node_id,
                    at=at,
                    gpu=gpu,
                    utilization_pct=90 + (k + gpu) % 10,
                    memory_used_mib=70_000,
                    temperature_c=60 + (k + gpu) % 15,
                    power_w=600 + (k * 7 + gpu) % 100,
                )

    minutes = copy_objects(GpuMinute, readings(GpuMinute, start, 60, MONTH * 1440))
    samples = copy_objects(GpuSample, readings(GpuSample, NOW - dt.timedelta(days=1), 10, 8640))
    print(f"  {minutes:,} GPU minutes, {samples:,} GPU samples", flush=True)


SEEDS = [
    seed_fleet,
    seed_people,
    seed_jobs,
    seed_job_output,
    seed_checkpoints,
    seed_ledger,
    seed_telemetry,
]


def analyze() -> None:
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def pages(s: Seeded) -> list[tuple[str, object, str]]:
    """(name, user, url) of every page and live fragment measured."""
    job, done = s.big_job_id, s.finished_job_id
    day_ago = (NOW - dt.timedelta(days=1)).isoformat().replace("+00:00", "Z")
    month = f"since={(NOW.date() - dt.timedelta(days=MONTH)).isoformat()}&until={NOW.date()}"
    submit = "gpus=16&gpus_per_node=8&preset=small&gpu_type=H100&time_limit_hours=4"
    trainer = (
        "kind=trainer&layout=&priority=normal&placement=owned_then_cloud&dataset=synthetic"
        "&steps=1000&global_batch=64&seq_len=2048&check_memory=on"
    )
    return [
        ("queue", s.researcher, "/jobs/"),
        ("queue-page-10", s.researcher, "/jobs/?page=10"),
        ("queue-my-team", s.researcher, "/jobs/?team=team-0"),
        ("queue-live", s.researcher, "/jobs/queue/live/"),
        ("history", s.researcher, "/jobs/history/"),
        ("history-failed", s.researcher, "/jobs/history/?state=failed"),
        ("job", s.researcher, f"/jobs/{job}/"),
        ("job-live", s.researcher, f"/jobs/{job}/live/"),
        ("job-log-tail", s.researcher, f"/jobs/{job}/log-tail/"),
        ("job-training", s.researcher, f"/jobs/{job}/training/"),
        ("job-checkpoints", s.researcher, f"/checkpoints/jobs/{job}/"),
        ("job-finished", s.researcher, f"/jobs/{done}/"),
        ("compare", s.researcher, f"/jobs/compare/?job={job}&job={done}"),
        ("submit", s.researcher, "/jobs/submit/"),
        ("submit-layouts", s.researcher, f"/jobs/submit/layouts/?{submit}"),
        ("submit-outlook", s.researcher, f"/jobs/submit/outlook/?{submit}&team={s.team_ids[0]}"),
        ("submit-advice", s.researcher, f"/jobs/submit/advice/?{submit}&{trainer}"),
        ("estimates", s.researcher, "/jobs/estimates/"),
        ("fleet", s.ops, "/fleet/"),
        ("fleet-pool", s.ops, f"/fleet/?pool={s.pool_ids[0]}"),
        ("fleet-live", s.ops, "/fleet/live/"),
        ("node", s.ops, f"/fleet/nodes/{s.node_name}/"),
        ("node-live", s.ops, f"/fleet/nodes/{s.node_name}/live/"),
        ("checkpoints", s.researcher, "/checkpoints/"),
        ("checkpoints-ops", s.ops, "/checkpoints/"),
        ("checkpoints-live", s.researcher, "/checkpoints/live/"),
        ("costs", s.finance, "/costs/"),
        ("costs-month-by-team", s.finance, f"/costs/?{month}&group_by=team"),
        ("costs-idle-spread", s.finance, f"/costs/?{month}&group_by=team&idle=spread"),
        (
            "costs-team-idle-spread",
            s.finance,
            f"/costs/?{month}&group_by=team&team_id={s.team_ids[0]}&idle=spread",
        ),
        ("costs-by-pool", s.finance, f"/costs/?{month}&group_by=pool"),
        ("costs-figures", s.finance, f"/costs/figures/?{month}&group_by=team&idle=spread"),
        ("costs-researcher", s.researcher, "/costs/"),
        ("nccl-profiles", s.ops, "/nccl/profiles/"),
        ("nccl-profile", s.ops, f"/nccl/profiles/{s.profile_name}/"),
        ("nccl-lint", s.ops, "/nccl/lint/"),
        ("nccl-variables", s.ops, "/nccl/variables/"),
        ("tokens", s.researcher, "/tokens/"),
        ("api-jobs", s.researcher, "/api/v1/jobs/"),
        ("api-jobs-ops", s.ops, "/api/v1/jobs/"),
        ("api-queue", s.researcher, "/api/v1/queue/"),
        ("api-nodes", s.ops, "/api/v1/nodes/"),
        ("api-node-telemetry", s.ops, f"/api/v1/nodes/{s.node_id}/telemetry/?since={day_ago}"),
    ]


def measure(client, url: str) -> tuple[float, int, int]:
    """(median ms, queries of one request, status) of `url`, after one warm-up request."""
    began = time.perf_counter()
    answer = client.get(url)
    # A page ten times over the goal is timed once more, not REPEAT times.
    repeat = REPEAT if time.perf_counter() - began < GOAL_MS * 10 / 1000 else 1
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        answer = client.get(url)
        if getattr(answer, "streaming", False):
            b"".join(answer.streaming_content)
        times.append((time.perf_counter() - began) * 1000)
    with CaptureQueriesContext(connection) as queries:
        client.get(url)
    sql_ms = sum(float(q["time"]) for q in queries.captured_queries) * 1000
    return statistics.median(times), len(queries.captured_queries), sql_ms, answer.status_code


def found(seeded: Seeded) -> Seeded:
    """The seeded users and ids, read back (for a kept database)."""
    from django.contrib.auth import get_user_model

    from apps.accounts.models import Team
    from apps.fleet.models import NodePool
    from apps.jobs.models import Job, Run
    from apps.tuning.models import NcclProfile

    User = get_user_model()
    seeded.researcher = User.objects.get(username="user-team-0")
    seeded.ops = User.objects.get(username="bench-ops")
    seeded.finance = User.objects.get(username="bench-finance")
    seeded.team_ids = list(Team.objects.order_by("id").values_list("id", flat=True))
    seeded.pool_ids = list(NodePool.objects.order_by("id").values_list("id", flat=True))
    seeded.big_job_id = 1
    seeded.finished_job_id = (
        Job.objects.filter(team_id=seeded.team_ids[0], state="succeeded").values("id").first()
    )["id"]
    seeded.node_id, seeded.node_name = Run.objects.filter(
        job_id=seeded.big_job_id, node_rank=0
    ).values_list("node_id", "node__name")[0]
    seeded.profile_name = NcclProfile.objects.order_by("name").values_list("name", flat=True)[0]
    return seeded


def main() -> int:
    if connection.vendor != "postgresql":
        print("bench/pages.py needs PostgreSQL (COPY): set DATABASE_URL.")
        return 2
    from django.test import Client

    from apps.jobs.models import Job

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(
        verbosity=0, autoclobber=not KEEP, keepdb=KEEP, serialize=False
    )
    rng = random.Random(20261205)
    results = []
    try:
        seeded = Seeded()
        if not Job.objects.exists():
            began = time.perf_counter()
            for seed in SEEDS:
                step = time.perf_counter()
                seed(rng, seeded)
                print(f"{seed.__name__}: {time.perf_counter() - step:.0f}s", flush=True)
            analyze()
            print(f"seeded in {time.perf_counter() - began:.0f}s", flush=True)
        found(seeded)
        publish_queue_order()
        speed = interpreter_ms()
        clients = {}
        only = {n for n in os.environ.get("BENCH_PAGES", "").split(",") if n}
        for name, user, url in pages(seeded):
            if only and name not in only:
                continue
            if user.pk not in clients:
                clients[user.pk] = Client()
                clients[user.pk].force_login(user)
            ms, queries, sql_ms, status = measure(clients[user.pk], url)
            results.append((name, ms, queries))
            print(
                f"{name:<24} {ms:7.1f} ms {queries:4d} queries ({sql_ms:6.1f} ms of SQL)  "
                f"{status}  {user.username}  {url}",
                flush=True,
            )
            assert status == 200, (name, url, status)
    finally:
        if not KEEP:
            connection.creation.destroy_test_db(old_name, verbosity=0)
    over = [r for r in results if r[1] > GOAL_MS]
    print(
        f"python {platform.python_version()}, database {connection.vendor}, {os.cpu_count()} "
        f"CPUs, sum(range(10**6)) in {speed:.1f} ms; jobs={JOBS} nodes={NODES}; "
        f"over {GOAL_MS} ms: {', '.join(r[0] for r in over) or 'none'}"
    )
    worst = max(results, key=lambda r: r[1])
    print(f"pages: worst_ms={worst[1]:.0f} worst_page={worst[0]} pages={len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
