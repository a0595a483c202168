"""What was spent: a job's cost, spend reports from the roll-ups, the ledger as CSV."""

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.db.models import Min, QuerySet, Sum
from django.utils import timezone

from apps.accounts.selectors import roles_of, team_slugs
from apps.costs.models import (
    DailySpend,
    JobDailySpend,
    MeterMark,
    MonthlySpend,
    UsageEntry,
)
from apps.costs.money import ZERO
from apps.costs.selectors.months import CAPACITY_LABELS, IDLE_LABEL, month_after
from apps.costs.selectors.prices import (
    PriceBook,
    node_rows,
    projection_for,
    rate_now,
)
from apps.fleet.selectors import instance_type_names, pool_slugs

# --- a job's cost ---------------------------------------------------------------------------


def job_costs_so_far(*, job_ids) -> dict[int, Decimal]:
    """What each job has cost, as metered (the daily roll-ups)."""
    return {
        job_id: total
        for job_id, total in JobDailySpend.objects.filter(job_id__in=list(job_ids))
        .values_list("job_id")
        .annotate(total=Sum("amount"))
        .order_by()
    }


@dataclass(frozen=True)
class JobCost:
    so_far: Decimal
    metered_until: dt.datetime | None
    per_hour: Decimal | None  # the rate of the GPUs it holds now
    projected: Decimal | None  # so far + per hour × what is left of its time limit
    low: Decimal | None = None  # before placement: the cheapest eligible pool...
    high: Decimal | None = None  # ...and the dearest
    cheapest_pool: str = ""
    currency: str = "USD"

    def as_dict(self) -> dict:
        def text(value):
            return None if value is None else str(value.quantize(Decimal("0.000001")))

        return {
            "so_far": text(self.so_far),
            "metered_until": self.metered_until,
            "per_hour": text(self.per_hour),
            "projected": text(self.projected),
            "projected_low": text(self.low),
            "projected_high": text(self.high),
            "cheapest_pool": self.cheapest_pool,
            "currency": self.currency,
        }


def job_cost(
    *,
    job_id: int,
    gpus: int,
    time_limit_s: int,
    started_at: dt.datetime | None,
    held: list[tuple[int, int]],
    candidate_pool_ids=(),
    spot_allowed: bool = False,
    now: dt.datetime | None = None,
) -> JobCost:
    """Cost so far, and projected: once it holds GPUs, so far plus their rate × the rest of
    its time limit; before that, its GPUs × time limit at the cheapest eligible pool's rate,
    with the dearest as the range's top. `held`: (node id, GPUs) it holds now."""
    now = now or timezone.now()
    so_far = job_costs_so_far(job_ids=[job_id]).get(job_id, ZERO)
    node_ids = [node_id for node_id, _ in held]
    metered_until = (
        MeterMark.objects.filter(node_id__in=node_ids).aggregate(at=Min("metered_until"))["at"]
        if node_ids
        else None
    )
    currency = settings.COSTS_CURRENCY
    if held:
        nodes = node_rows(node_ids)
        book = PriceBook.read(list(nodes.values()), since=now, until=now + dt.timedelta(seconds=1))
        per_hour = ZERO
        for node_id, node_gpus in held:
            node = nodes.get(node_id)
            if node is None or not node.gpus:
                continue
            rate = rate_now(book.timeline(node, node.power_w), now)
            per_hour += rate.per_hour * node_gpus / node.gpus
        elapsed = (now - started_at).total_seconds() if started_at else 0
        left = Decimal(max(time_limit_s - elapsed, 0)) / 3600
        return JobCost(
            so_far=so_far,
            metered_until=metered_until,
            per_hour=per_hour,
            projected=so_far + per_hour * left,
            currency=currency,
        )
    projection = (
        projection_for(
            pool_ids=candidate_pool_ids,
            gpus=gpus,
            time_limit_s=time_limit_s,
            spot_allowed=spot_allowed,
        )
        if candidate_pool_ids
        else None
    )
    if projection is None:
        return JobCost(
            so_far=so_far, metered_until=None, per_hour=None, projected=None, currency=currency
        )
    return JobCost(
        so_far=so_far,
        metered_until=None,
        per_hour=projection.per_gpu_hour * gpus,
        projected=so_far + projection.low,
        low=so_far + projection.low,
        high=so_far + projection.high,
        cheapest_pool=projection.cheapest_pool,
        currency=currency,
    )


# --- spend reports --------------------------------------------------------------------------


def _of_visible_teams(rows: QuerySet, user) -> QuerySet:
    """The rows of the teams the user reads (every team's, idle's too, for ops and finance)."""
    roles = roles_of(user)
    return rows if roles.sees_every_team else rows.filter(team_id__in=roles.team_ids)


def daily_spend_visible_to(*, user) -> QuerySet[DailySpend]:
    return _of_visible_teams(DailySpend.objects.all(), user)


def monthly_spend_visible_to(*, user) -> QuerySet[MonthlySpend]:
    return _of_visible_teams(MonthlySpend.objects.all(), user)


def job_spend_visible_to(*, user) -> QuerySet[JobDailySpend]:
    return _of_visible_teams(JobDailySpend.objects.all(), user)


def usage_visible_to(*, user) -> QuerySet[UsageEntry]:
    return _of_visible_teams(UsageEntry.objects.all(), user)


GROUPS = {
    "team": "team_id",
    "pool": "pool_id",
    "capacity_type": "capacity_type",
    "instance_type": "instance_type_id",
}


def _labels(group_by: str, keys) -> dict:
    keys = set(keys)
    if group_by == "team":
        names = team_slugs(team_ids=keys)
        return {k: names.get(k, IDLE_LABEL if k == 0 else f"team {k}") for k in keys}
    if group_by == "pool":
        names = pool_slugs(pool_ids=keys)
        return {k: names.get(k, f"pool {k}") for k in keys}
    if group_by == "instance_type":
        names = instance_type_names(type_ids=keys)
        return {k: names.get(k, "owned (none)" if k == 0 else f"type {k}") for k in keys}
    return {k: CAPACITY_LABELS.get(k, k) for k in keys}


def whole_months(since: dt.date, until: dt.date) -> list[dt.date]:
    """The months wholly inside [since, until], as their first days."""
    first = since if since.day == 1 else month_after(since.replace(day=1))
    months = []
    while month_after(first) - dt.timedelta(days=1) <= until:
        months.append(first)
        first = month_after(first)
    return months


@dataclass(frozen=True)
class RollUps:
    """The roll-ups a report reads, filtered alike: `daily` already cut to [since, until],
    `monthly` not cut (whole months inside the range are read from it, the days at either
    end from `daily`)."""

    daily: QuerySet
    monthly: QuerySet | None = None

    def sums(self, fields: tuple, *, since: dt.date, until: dt.date) -> list[dict]:
        whole = whole_months(since, until) if self.monthly is not None else []
        if whole:
            parts = [
                self.monthly.filter(month__in=whole),
                self.daily.exclude(day__gte=whole[0], day__lt=month_after(whole[-1])),
            ]
        else:
            parts = [self.daily]
        sums = {
            "amount": Sum("amount"),
            "savings": Sum("savings"),
            "gpu_seconds": Sum("gpu_seconds"),
        }
        merged: dict[tuple, dict] = {}
        for part in parts:
            if fields:
                rows = part.values(*fields).annotate(**sums).order_by()
            else:  # one total over the rows
                rows = [part.aggregate(**sums)]
            for row in rows:
                key = tuple(row[f] for f in fields)
                cell = merged.setdefault(
                    key,
                    {
                        **dict(zip(fields, key, strict=True)),
                        "amount": ZERO,
                        "savings": ZERO,
                        "gpu_seconds": 0,
                    },
                )
                cell["amount"] += row["amount"] or ZERO
                cell["savings"] += row["savings"] or ZERO
                cell["gpu_seconds"] += row["gpu_seconds"] or 0
        return list(merged.values())


def _as_rollups(source: RollUps | QuerySet) -> RollUps:
    """A queryset of days alone is roll-ups without months."""
    return source if isinstance(source, RollUps) else RollUps(daily=source)


def rollups_between(*, since: dt.date, until: dt.date) -> RollUps:
    """Every team's roll-ups over the days, unfiltered."""
    return RollUps(
        daily=DailySpend.objects.filter(day__gte=since, day__lte=until),
        monthly=MonthlySpend.objects.all(),
    )


@dataclass
class SpendRow:
    key: object
    label: str
    jobs: Decimal = ZERO  # attributed to jobs
    idle: Decimal = ZERO  # idle capacity (spread over teams in "spread" mode)
    savings: Decimal = ZERO
    gpu_hours: Decimal = ZERO

    @property
    def total(self) -> Decimal:
        return self.jobs + self.idle


@dataclass
class SpendReport:
    since: dt.date
    until: dt.date
    group_by: str
    idle_mode: str
    rows: list[SpendRow]
    total: Decimal
    jobs: Decimal
    idle: Decimal
    savings: Decimal
    series: dict = field(default_factory=dict)  # label -> {day: amount}
    days: list = field(default_factory=list)


def spend_report(
    source: RollUps | QuerySet,
    *,
    since: dt.date,
    until: dt.date,
    group_by: str = "team",
    idle_mode: str | None = None,
    spread_base: RollUps | QuerySet | None = None,
    series_groups: int = 6,
) -> SpendReport:
    """Spend over [since, until] (days, inclusive) grouped by team, pool, capacity type or
    instance type, from the roll-ups (already filtered; a queryset of days alone will do).
    With idle spread, each team also carries idle cost in proportion to its use over the
    period (`spread_base`: the same filters over every team, so a team sees its share of
    the whole fleet's idle).

    The series by day (for the chart) holds the `series_groups` largest groups and the rest
    as "other"; 0 leaves it out."""
    idle_mode = idle_mode or settings.COSTS_IDLE_COST
    column = GROUPS[group_by]
    source = _as_rollups(source)
    fields = (column, "team_id") if column != "team_id" else ("team_id",)
    cells: dict[object, SpendRow] = {}
    for row in source.sums(fields, since=since, until=until):
        key = row[column]
        if group_by == "team" and key == 0 and idle_mode == "spread":
            key = None  # spread below
        cell = cells.setdefault(key, SpendRow(key=key, label=""))
        if row["team_id"] == 0:
            cell.idle += row["amount"] or ZERO
        else:
            cell.jobs += row["amount"] or ZERO
        cell.savings += row["savings"] or ZERO
        cell.gpu_hours += Decimal(row["gpu_seconds"] or 0) / 3600
    if group_by == "team" and idle_mode == "spread":
        base = _as_rollups(spread_base) if spread_base is not None else source
        idle = used = ZERO
        for row in base.sums(("team_id",), since=since, until=until):
            if row["team_id"] == 0:
                idle += row["amount"]
            else:
                used += row["amount"]
        spread = cells.pop(None, None)
        if used:
            for key, cell in cells.items():
                cell.idle = idle * cell.jobs / used if key else ZERO
        elif spread is not None:
            cells[0] = spread  # nobody used anything: idle stays idle
    labels = _labels(group_by, [k for k in cells if k is not None])
    rows = []
    for key, cell in cells.items():
        cell.label = labels.get(key, str(key))
        rows.append(cell)
    rows.sort(key=lambda r: (-r.total, r.label))
    series = _series(source.daily, column, rows[:series_groups]) if series_groups else {}
    days = []
    day = since
    while day <= until:
        days.append(day)
        day += dt.timedelta(days=1)
    jobs = sum((r.jobs for r in rows), ZERO)
    idle_total = sum((r.idle for r in rows), ZERO)
    return SpendReport(
        since=since,
        until=until,
        group_by=group_by,
        idle_mode=idle_mode,
        rows=rows,
        total=jobs + idle_total,
        jobs=jobs,
        idle=idle_total,
        savings=sum((r.savings for r in rows), ZERO),
        series=series,
        days=days,
    )


def _series(qs: QuerySet[DailySpend], column: str, top: list[SpendRow]) -> dict[str, dict]:
    """{label: {day: amount}} for the largest groups, and every other group as "other"
    (two small queries however many groups there are)."""
    keys = {row.key: row.label for row in top if row.key is not None}
    series: dict[str, dict] = defaultdict(dict)
    shown: dict = defaultdict(lambda: ZERO)
    for day, key, amount in (
        qs.filter(**{f"{column}__in": list(keys)})
        .values_list("day", column)
        .annotate(amount=Sum("amount"))
        .order_by("day")
    ):
        series[keys[key]][day] = amount or ZERO
        shown[day] += amount or ZERO
    for day, amount in qs.values_list("day").annotate(amount=Sum("amount")).order_by("day"):
        rest = (amount or ZERO) - shown[day]
        if rest:
            series["other"][day] = rest
    return dict(series)


@dataclass(frozen=True)
class TopJob:
    job_id: int
    name: str
    team: str
    amount: Decimal
    gpu_hours: Decimal


def top_jobs(qs: QuerySet[JobDailySpend], *, limit: int = 20) -> list[TopJob]:
    rows = list(
        qs.values("job_id")
        .annotate(amount=Sum("amount"), gpu_seconds=Sum("gpu_seconds"))
        .order_by("-amount", "job_id")[:limit]
    )
    # Names through the roll-up's reference to "jobs.Job" (costs never imports jobs).
    jobs = JobDailySpend._meta.get_field("job").related_model
    names = {
        job_id: (name, team)
        for job_id, name, team in jobs.objects.filter(
            pk__in=[r["job_id"] for r in rows]
        ).values_list("id", "name", "team__slug")
    }
    return [
        TopJob(
            job_id=row["job_id"],
            name=names.get(row["job_id"], (f"job {row['job_id']}", ""))[0],
            team=names.get(row["job_id"], ("", ""))[1],
            amount=row["amount"] or ZERO,
            gpu_hours=Decimal(row["gpu_seconds"] or 0) / 3600,
        )
        for row in rows
    ]


def fleet_cost(*, since: dt.date, until: dt.date) -> Decimal:
    """The fleet's whole cost over the days (jobs plus idle), from the roll-ups."""
    rows = rollups_between(since=since, until=until).sums((), since=since, until=until)
    return sum((row["amount"] for row in rows), ZERO)


# --- the ledger as CSV ------------------------------------------------------------------------

USAGE_CSV_COLUMNS = [
    "id",
    "day",
    "start",
    "end",
    "node_id",
    "pool_id",
    "instance_type_id",
    "team_id",
    "job_id",
    "kind",
    "capacity_type",
    "gpus",
    "node_gpus",
    "rate_per_hour",
    "amount",
    "savings",
    "power_w",
    "price_ref",
    "corrects_id",
    "note",
]
_MONEY_COLUMNS = {"rate_per_hour", "amount", "savings"}
_TIME_COLUMNS = {"start", "end"}
_TEXT_COLUMNS = {"price_ref", "note"}


def _utc_text(moment: dt.datetime) -> str:
    """As PostgreSQL writes a timestamptz in UTC (so both databases export alike)."""
    moment = moment.astimezone(dt.UTC)
    fraction = f".{moment.microsecond:06d}".rstrip("0") if moment.microsecond else ""
    return f"{moment:%Y-%m-%d %H:%M:%S}{fraction}+00"


def usage_csv_chunks(rows: QuerySet[UsageEntry]):
    """The ledger rows as CSV text, by day then id, streamed: on PostgreSQL the database
    formats them itself (COPY … TO STDOUT), which keeps up with millions of rows."""
    from django.db import connection, transaction

    from controlplane.exports import spreadsheet_safe

    raw = rows.order_by().values_list(*USAGE_CSV_COLUMNS)
    if connection.vendor == "postgresql":
        inner, params = raw.query.sql_with_params()
        bound = connection.ops.compose_sql(inner, params)

        def shown(column: str) -> str:
            value = f'e."{column}"'
            if column in _MONEY_COLUMNS:  # nano-units × 10⁻⁹: exact, nine decimals
                return f"{value} * 0.000000001"
            if column in _TEXT_COLUMNS:  # what a spreadsheet would run as a formula
                return (
                    f"CASE WHEN left({value}, 1) IN ('=', '+', '-', '@', chr(9), chr(13)) "
                    f"THEN '''' || {value} ELSE {value} END"
                )
            return value  # times as PostgreSQL writes them in UTC: 2026-11-02 00:00:00+00

        select = ", ".join(shown(c) for c in USAGE_CSV_COLUMNS)
        copy_sql = (
            f"COPY (SELECT {select} FROM ({bound}) AS e ORDER BY e.day, e.id) "  # noqa: S608
            "TO STDOUT WITH (FORMAT csv)"
        )
        # Read in (day, id) order, which the ledger's index gives without sorting: with its
        # default random_page_cost (4, for spinning disks) PostgreSQL would rather scan the
        # whole table and sort, ten times slower on tens of millions of rows.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL random_page_cost = 1.1")
            cursor.execute("SET LOCAL jit = off")
            with cursor.cursor.copy(copy_sql) as copy:
                buffer = bytearray()  # COPY hands over a row at a time: send 64 kB at once
                for data in copy:
                    buffer += data
                    if len(buffer) >= 65536:
                        yield bytes(buffer)
                        buffer.clear()
                if buffer:
                    yield bytes(buffer)
        return
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    for count, row in enumerate(raw.order_by("day", "id").iterator(chunk_size=5000), 1):
        writer.writerow(
            [
                f"{value:f}"
                if column in _MONEY_COLUMNS
                else _utc_text(value)
                if column in _TIME_COLUMNS
                else spreadsheet_safe(value)
                if column in _TEXT_COLUMNS
                else ("" if value is None else value)
                for column, value in zip(USAGE_CSV_COLUMNS, row, strict=True)
            ]
        )
        if count % 2000 == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    if buffer.tell():
        yield buffer.getvalue()
