"""The finance queries over a ledger of 10 million rows, on PostgreSQL.

Loads BENCH_ROWS (10,000,000) ledger rows with COPY: 92 days of 10,000 8-GPU nodes in
20 pools (10 owned, 10 cloud), 1,000 teams each on two pools, about 14% idle. Builds the
daily roll-ups from them (metering keeps them incrementally; a bulk load rebuilds them
once), then times:

    month_by_team_ms   the Costs table for a month grouped by team (roll-ups), median of 7
    report_ms          the whole Costs report (table, chart series, top jobs, budgets, forecast)
    csv_rows_per_s     the ledger CSV of one week streamed through the page's view
    meter_ms           one metering run over the 10,000 nodes for 5 minutes (the incremental path)

Goals: month_by_team_ms ≤ 200, csv_rows_per_s ≥ 100,000.
Last line: `costs: rows=<n> month_by_team_ms=<n> csv_rows_per_s=<n>`.
"""

import datetime as dt
import os
import platform
import statistics
import sys
import time
from decimal import Decimal

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.db import connection  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402

ROWS = int(os.environ.get("BENCH_ROWS", "10000000"))
NODES = int(os.environ.get("BENCH_NODES", "10000"))
TEAMS = 1000
POOLS = 20
DAYS = 92
FIRST_DAY = dt.date(2026, 9, 1)
MONTH = (dt.date(2026, 11, 1), dt.date(2026, 11, 30))
WEEK = ("2026-11-09", "2026-11-15")
OWNED_RATE, CLOUD_RATE = 12_121_644_000, 55_040_000_000  # nano-dollars a node-hour


def build_fleet(*, sites: int = 0) -> tuple[list[int], list[int]]:
    """POOLS pools of NODES // POOLS 8-GPU nodes (the first half owned, the rest cloud) and
    TEAMS teams; with `sites`, the owned pools are spread over that many sites and their
    nodes stand in racks of 8 (bench/pages.py)."""
    from apps.accounts.models import Team
    from apps.fleet.models import InstanceType, Node, NodePool, Rack, Site

    p5 = InstanceType.objects.get(name="p5.48xlarge")
    where = [Site.objects.create(name=f"site {i}", slug=f"site-{i}") for i in range(sites)]
    pools = []
    for i in range(POOLS):
        cloud = i >= POOLS // 2
        pools.append(
            NodePool.objects.create(
                name=f"bench-{i}",
                slug=f"bench-{i}",
                kind="cloud" if cloud else "owned",
                gpu_type="H100",
                region="us-east-1" if cloud else "",
                site=where[i % sites] if where and not cloud else None,
                max_nodes=NODES,
            )
        )
    per_pool = NODES // POOLS
    # Rack i holds nodes 8i to 8i + 7, in an owned pool's site.
    racked = [i for i in range(NODES // 8) if where and pools[i * 8 // per_pool].site]
    racks = dict(
        zip(
            racked,
            Rack.objects.bulk_create(
                [
                    Rack(site=pools[i * 8 // per_pool].site, name=f"r{i:04d}", power_budget_kw=80)
                    for i in racked
                ],
                batch_size=2000,
            ),
            strict=True,
        )
    )
    Node.objects.bulk_create(
        [
            Node(
                name=f"n{i:05d}",
                pool=pools[i // per_pool],
                rack=racks.get(i // 8),
                rack_unit=1 + (i % 8) * 4 if i // 8 in racks else None,
                provider="aws" if pools[i // per_pool].kind == "cloud" else "ssh",
                capacity_type="on_demand" if pools[i // per_pool].kind == "cloud" else "owned",
                instance_type=p5 if pools[i // per_pool].kind == "cloud" else None,
                gpu_type="H100",
                gpu_count=8,
                state="busy",
            )
            for i in range(NODES)
        ],
        batch_size=2000,
    )
    Team.objects.bulk_create(
        [Team(name=f"team {i}", slug=f"team-{i}") for i in range(TEAMS)], batch_size=2000
    )
    return (
        [p.pk for p in pools],
        list(Node.objects.order_by("id").values_list("id", flat=True)),
    )


def ledger_lines(pool_ids, node_ids, team_ids, p5_id):
    """The ledger as COPY text, a day at a time (cheap arithmetic, no random calls)."""
    per_day = -(-ROWS // DAYS)
    slices = -(-per_day // NODES)  # pieces of each node's day
    seconds = 86400 // slices
    per_pool = NODES // POOLS
    written = 0
    for d in range(DAYS):
        day = FIRST_DAY + dt.timedelta(days=d)
        midnight = dt.datetime.combine(day, dt.time(0), tzinfo=dt.UTC)
        stamps = [
            (midnight + dt.timedelta(seconds=s * seconds)).isoformat() for s in range(slices + 1)
        ]
        recorded = (midnight + dt.timedelta(days=1, minutes=5)).isoformat()
        lines = []
        for j in range(min(per_day, ROWS - written)):
            n, s = j % NODES, j // NODES
            pool = n // per_pool
            cloud = pool >= POOLS // 2
            rate = CLOUD_RATE if cloud else OWNED_RATE
            amount = rate * seconds // 3600
            idle = (n * 13 + s + d) % 7 == 0
            if idle:
                team, job, kind = "\\N", "\\N", "idle"
            else:
                t = (pool % (POOLS // 2)) * (TEAMS // (POOLS // 2)) + (n * 7 + s + d) % (
                    TEAMS // (POOLS // 2)
                )
                team, job, kind = team_ids[t], t * 1000 + d // 3, "job"
            lines.append(
                f"{node_ids[n]}\t{pool_ids[pool]}\t{p5_id if cloud else chr(92) + 'N'}\t"
                f"{team}\t{job}\t{kind}\t{'on_demand' if cloud else 'owned'}\t8\t8\t"
                f"{stamps[s]}\t{stamps[s + 1]}\t{day}\t{rate}\t{amount}\t0\t\\N\t"
                f"{'cloud:1' if cloud else 'owned:1'}\t\\N\t\t{recorded}\n"
            )
        written += len(lines)
        yield "".join(lines)
        if written >= ROWS:
            return


def load(pool_ids, node_ids) -> int:
    from apps.accounts.models import Team
    from apps.costs.models import UsageEntry
    from apps.fleet.models import InstanceType

    team_ids = list(Team.objects.order_by("id").values_list("id", flat=True))
    p5_id = InstanceType.objects.get(name="p5.48xlarge").pk
    columns = (
        "node_id, pool_id, instance_type_id, team_id, job_id, kind, capacity_type, gpus, "
        'node_gpus, start, "end", day, rate_per_hour, amount, savings, power_w, price_ref, '
        "corrects_id, note, recorded_at"
    )
    # The ledger's secondary indexes are built once after the load (a sort, much faster
    # than keeping them up to date row by row), as one would restore a dump.
    with connection.schema_editor() as editor:
        for index in UsageEntry._meta.indexes:
            editor.remove_index(UsageEntry, index)
    loaded = 0
    with connection.cursor() as cursor:  # noqa: SIM117 (the COPY needs the raw cursor)
        with cursor.cursor.copy(f"COPY {UsageEntry._meta.db_table} ({columns}) FROM STDIN") as copy:
            for day, chunk in enumerate(ledger_lines(pool_ids, node_ids, team_ids, p5_id)):
                copy.write(chunk)
                loaded += chunk.count("\n")
                if day % 20 == 19:
                    print(f"  {loaded:,} rows", flush=True)
    began = time.perf_counter()
    with connection.schema_editor() as editor:
        for index in UsageEntry._meta.indexes:
            editor.add_index(UsageEntry, index)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {UsageEntry._meta.db_table}")
    print(f"  indexes built in {time.perf_counter() - began:.0f}s", flush=True)
    return loaded


def timed(fn, repeat: int = 7) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        began = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times), result


def main() -> int:
    if connection.vendor != "postgresql":
        print("bench/costs.py needs PostgreSQL (COPY): set DATABASE_URL.")
        return 2
    from django.http import QueryDict
    from django.test import Client

    from apps.accounts.models import OrgRole, OrgRoleName
    from apps.costs import reports, selectors, services
    from apps.costs.models import DailySpend, MonthlySpend
    from tests import factories

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    try:
        began = time.perf_counter()
        pool_ids, node_ids = build_fleet()
        loaded = load(pool_ids, node_ids)
        print(f"loaded {loaded:,} ledger rows in {time.perf_counter() - began:.0f}s", flush=True)
        began = time.perf_counter()
        rollups = services.rollups_rebuild()
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {DailySpend._meta.db_table}")
            cursor.execute(f"ANALYZE {MonthlySpend._meta.db_table}")
        print(f"built {rollups:,} daily roll-up rows in {time.perf_counter() - began:.1f}s")

        rollups = selectors.rollups_between(since=MONTH[0], until=MONTH[1])
        table_ms, spend = timed(
            lambda: selectors.spend_report(
                rollups, since=MONTH[0], until=MONTH[1], group_by="team", series_groups=0
            )
        )
        print(f"month by team (the query): {len(spend.rows)} rows, {table_ms:.0f} ms")

        finance = factories.make_user(username="bench-finance")
        OrgRole.objects.create(user=finance, role=OrgRoleName.FINANCE)
        api = Client()
        api.force_login(finance)
        month_query = f"since={MONTH[0]}&until={MONTH[1]}&group_by=team"

        def month_by_team():
            answer = api.get(f"/api/v1/spend/?{month_query}")
            assert answer.status_code == 200, answer.content
            return answer.json()

        month_ms, answer = timed(month_by_team)
        print(
            f"month by team (GET /api/v1/spend/): {len(answer['rows'])} rows, "
            f"total {Decimal(answer['total']):,.2f}, {month_ms:.0f} ms"
        )
        query = QueryDict(month_query)
        report_ms, _ = timed(lambda: reports.build(user=finance, query=query), repeat=3)
        print(f"the whole Costs report (chart, top jobs, budgets, forecast): {report_ms:.0f} ms")

        client = Client()
        client.force_login(finance)
        began = time.perf_counter()
        response = client.get(f"/costs/usage.csv?since={WEEK[0]}&until={WEEK[1]}")
        lines = sum(
            (chunk if isinstance(chunk, bytes) else chunk.encode()).count(b"\n")
            for chunk in response.streaming_content
        )
        csv_s = time.perf_counter() - began
        csv_rows = lines - 1  # the header
        print(f"ledger CSV of a week: {csv_rows:,} rows in {csv_s:.2f}s")

        from apps.costs.models import MeterMark
        from apps.fleet.models import Node

        start = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
        MeterMark.objects.bulk_create(
            [MeterMark(node_id=n, metered_until=start) for n in node_ids], batch_size=5000
        )
        Node.objects.update(
            created_at=start - dt.timedelta(days=100), launched_at=start - dt.timedelta(days=100)
        )
        began = time.perf_counter()
        metered = services.usage_meter(
            allocations_for=lambda **_: [], until=start + dt.timedelta(minutes=5)
        )
        meter_ms = (time.perf_counter() - began) * 1000
        print(
            f"metering {metered.nodes:,} nodes for 5 minutes: {metered.rows:,} rows, "
            f"{meter_ms:.0f} ms"
        )
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(
        f"python {platform.python_version()}, database {connection.vendor}, "
        f"{os.cpu_count()} CPUs; report_ms={report_ms:.0f} meter_ms={meter_ms:.0f}"
    )
    print(
        f"costs: rows={loaded} month_by_team_ms={month_ms:.0f} "
        f"csv_rows_per_s={csv_rows / csv_s:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
