"""What was spent: a job's cost, spend reports from the roll-ups, the ledger as CSV."""

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.db.models import Case, Min, OuterRef, Q, QuerySet, Subquery, Sum, Value, When
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
from apps.costs.selectors.months import (
    CAPACITY_LABELS,
    IDLE_LABEL,
    local_midnight,
    local_today,
    month_after,
)
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


_SUMS = {"amount": Sum("amount"), "savings": Sum("savings"), "gpu_seconds": Sum("gpu_seconds")}
_IDLE = Q(team_id=0)
# Job spend and idle apart, in one pass over the rows (what a report with idle spread needs).
_SPLIT_SUMS = {
    "jobs": Sum("amount", filter=~_IDLE),
    "idle": Sum("amount", filter=_IDLE),
    "jobs_savings": Sum("savings", filter=~_IDLE),
    "idle_savings": Sum("savings", filter=_IDLE),
    "jobs_gpu_seconds": Sum("gpu_seconds", filter=~_IDLE),
    "idle_gpu_seconds": Sum("gpu_seconds", filter=_IDLE),
}


@dataclass(frozen=True)
class RollUps:
    """The roll-ups a report reads, filtered alike but for the days: `daily` is cut to the
    range asked for, and whole months inside it are read from `monthly` (the days at
    either end from `daily`)."""

    daily: QuerySet
    monthly: QuerySet | None = None

    def sums(
        self, fields: tuple, *, since: dt.date, until: dt.date, split: bool = False
    ) -> list[dict]:
        """Amount, savings and GPU-seconds by `fields` over [since, until]; with `split`,
        each of job spend and idle apart (jobs, idle, jobs_savings, idle_savings...)."""
        daily = self.daily.filter(day__gte=since, day__lte=until)
        whole = whole_months(since, until) if self.monthly is not None else []
        if whole:
            parts = [
                self.monthly.filter(month__in=whole),
                daily.exclude(day__gte=whole[0], day__lt=month_after(whole[-1])),
            ]
        else:
            parts = [daily]
        sums = _SPLIT_SUMS if split else _SUMS
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
                        **{name: 0 if name.endswith("seconds") else ZERO for name in sums},
                    },
                )
                for name in sums:
                    cell[name] += row[name] or 0
        return list(merged.values())


def _total(rows: list[dict]) -> dict:
    """The one row that sums((), split=True) would read, from rows of the same split sums
    by some group (sums of the same numbers: the very same figures)."""
    return {
        name: sum((row[name] for row in rows), 0 if name.endswith("seconds") else ZERO)
        for name in _SPLIT_SUMS
    }


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


@dataclass(frozen=True)
class _Spread:
    """Idle spread over teams by use: under the report's filters, every team carries the
    idle cost × its job spend ÷ every team's job spend over the whole period. The same
    shares apply to each group's and each day's idle, so a report's rows, its days and its
    total agree whichever way it is grouped, and a team's total is the same in every
    grouping."""

    by_team: bool
    share: dict  # group key -> the part of the idle it carries
    idle: dict  # group key (() grouped by team: all idle is every team's) -> idle row

    def idle_of(self, key) -> dict:
        return self.idle.get(() if self.by_team else key) or {}

    @classmethod
    def read(
        cls, base: RollUps | None, scope: dict, *, column: str, since, until
    ) -> "_Spread | None":
        """None when nobody used anything under the filters: then idle stays idle. `base`
        None: the use is the scope's own (every team's, under the same filters)."""
        by_team = column == "team_id"
        fields = () if by_team else (column,)
        if base is not None:
            rows = base.sums(fields, since=since, until=until, split=True)
        else:
            rows = [_total(list(scope.values()))] if by_team else list(scope.values())
        used = sum((row["jobs"] for row in rows), ZERO)
        if not used:
            return None
        if by_team:
            share = {key: row["jobs"] / used for key, row in scope.items() if key != 0}
        else:
            part = sum((row["jobs"] for row in scope.values()), ZERO) / used
            share = dict.fromkeys({*scope, *(row[column] for row in rows)}, part)
        return cls(by_team=by_team, share=share, idle={_key(row, fields): row for row in rows})


def _key(row: dict, fields: tuple):
    """A row's group key: () for one total, the value of one field, else a tuple."""
    if not fields:
        return ()
    return row[fields[0]] if len(fields) == 1 else tuple(row[f] for f in fields)


def _spend_row(key, got: dict | None, spread: _Spread | None) -> SpendRow:
    """One group's row from its sums (job spend and idle apart), idle spread or not."""
    got = got or {}
    jobs = got.get("jobs", ZERO)
    if spread is None:
        return SpendRow(
            key=key,
            label="",
            jobs=jobs,
            idle=got.get("idle", ZERO),
            savings=got.get("jobs_savings", ZERO) + got.get("idle_savings", ZERO),
            gpu_hours=Decimal(got.get("jobs_gpu_seconds", 0) + got.get("idle_gpu_seconds", 0))
            / 3600,
        )
    share = spread.share.get(key, ZERO)
    idle = spread.idle_of(key)
    return SpendRow(
        key=key,
        label="",
        jobs=jobs,
        idle=idle.get("idle", ZERO) * share,
        savings=got.get("jobs_savings", ZERO) + idle.get("idle_savings", ZERO) * share,
        gpu_hours=Decimal(got.get("jobs_gpu_seconds", 0)) / 3600,
    )


def _spend_rows(
    source: RollUps, base: RollUps, column: str, idle_mode: str, *, since, until
) -> tuple[list[SpendRow], _Spread | None]:
    """The rows of a report by `column`, unlabelled: job spend and idle as metered, or
    with idle spread (over `base`'s use)."""
    scope = {
        row[column]: row for row in source.sums((column,), since=since, until=until, split=True)
    }
    spread = None
    if idle_mode == "spread":
        # The same roll-ups as the rows' (finance, no team filter): their sums, not read again.
        spread = _Spread.read(
            None if base is source else base, scope, column=column, since=since, until=until
        )
    keys = set(scope)
    if spread is not None:  # the groups that carry spend or idle (idle itself, spread, not)
        keys = {k for k in keys if not (spread.by_team and k == 0)}
        keys |= {k for k, share in spread.share.items() if share}
    return [_spend_row(key, scope.get(key), spread) for key in keys], spread


def spend_total(
    source: RollUps,
    *,
    since: dt.date,
    until: dt.date,
    idle_mode: str | None = None,
    spread_base: RollUps | None = None,
) -> Decimal:
    """What spend_report's total would be (in any grouping), without the rest of it."""
    idle_mode = idle_mode or settings.COSTS_IDLE_COST
    if idle_mode != "spread":  # job spend and idle as metered: one row, not one a team
        (total,) = source.sums((), since=since, until=until, split=True)
        return total["jobs"] + total["idle"]
    rows, _ = _spend_rows(
        source,
        spread_base if spread_base is not None else source,
        "team_id",
        idle_mode,
        since=since,
        until=until,
    )
    return sum((row.total for row in rows), ZERO)


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
    With idle spread, each team carries idle cost in proportion to its use over the period
    (`spread_base`: the same filters over every team, so a team carries its share of the
    whole fleet's idle), in every grouping (see _Spread).

    Every figure of the Costs page, its CSVs and the API comes from here: the rows, their
    total, and the series by day (for the chart), which adds up to the same total: it
    holds the `series_groups` largest groups and the rest as "other"; 0 leaves it out."""
    idle_mode = idle_mode or settings.COSTS_IDLE_COST
    column = GROUPS[group_by]
    source = _as_rollups(source)
    base = _as_rollups(spread_base) if spread_base is not None else source
    rows, spread = _spend_rows(source, base, column, idle_mode, since=since, until=until)
    keys = [row.key for row in rows]
    labels = _labels(group_by, keys)
    for row in rows:
        row.label = labels.get(row.key, str(row.key))
    rows.sort(key=lambda r: (-r.total, r.label))
    series = {}
    if series_groups:
        series = _series(
            source.daily,
            base.daily,
            spread,
            column=column,
            top=rows[:series_groups],
            since=since,
            until=until,
        )
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


def _series(
    daily: QuerySet,
    base_daily: QuerySet | None,
    spread: _Spread | None,
    *,
    column: str,
    top: list[SpendRow],
    since: dt.date,
    until: dt.date,
) -> dict[str, dict]:
    """{label: {day: amount}} for the largest groups, and every other group as "other":
    each day's cells worked out as the rows are (the same shares), so the days add up to
    the rows. The database folds every group but the largest into one ("other") before
    the rows come back: a day has a handful of cells, not one a team (one query, two with
    idle spread)."""
    labels = {row.key: row.label for row in top}
    other = _other_key(labels)
    folded = {
        "group": Case(
            *[When(**{column: key}, then=Value(key)) for key in labels],
            default=Value(other),
            output_field=daily.model._meta.get_field(column),
        )
    }

    def by_day(rows: QuerySet, fields: tuple) -> dict:
        cells: dict[dt.date, dict] = defaultdict(dict)
        for row in RollUps(daily=rows.annotate(**folded)).sums(
            fields, since=since, until=until, split=True
        ):
            cells[row["day"]][_key(row, fields[1:])] = row
        return cells

    cells = by_day(daily, ("day", "group"))
    idle: dict[dt.date, dict] = {}
    if spread is not None and base_daily is daily:  # the same roll-ups: their cells' sums
        if spread.by_team:
            idle = {day: {(): _total(list(groups.values()))} for day, groups in cells.items()}
        else:
            idle = cells
    elif spread is not None:
        idle = by_day(base_daily, ("day",) if spread.by_team else ("day", "group"))
    # The shares the groups folded into "other" carry, together.
    share = {key: spread.share.get(key, ZERO) for key in labels} if spread else {}
    if spread is not None:
        share[other] = sum(spread.share.values(), ZERO) - sum(share.values(), ZERO)
    series: dict[str, dict] = defaultdict(dict)
    for day in sorted(set(cells) | set(idle)):
        for key in [*labels, other]:
            got = cells[day].get(key) or {}
            if spread is None:
                amount = got.get("jobs", ZERO) + got.get("idle", ZERO)
            else:
                idle_row = idle.get(day, {}).get(() if spread.by_team else key) or {}
                amount = got.get("jobs", ZERO) + idle_row.get("idle", ZERO) * share[key]
            if amount:
                name = labels.get(key, "other")
                series[name][day] = series[name].get(day, ZERO) + amount
    return dict(series)


def _other_key(keys) -> int | str:
    """A group key no group has: -1 where the largest groups' keys are ids, else a text
    no capacity type is."""
    return " other" if any(isinstance(key, str) for key in keys) else -1


@dataclass(frozen=True)
class ForecastWindow:
    """What a forecast of a month's spend averages: the last `days` whole days before
    today (today is not whole yet), and the days left in the month from now."""

    month: dt.date
    last: dt.date  # the month's last day
    days: int
    since: dt.date
    until: dt.date
    days_left: Decimal  # 0 for a month that is over (or not begun)

    @classmethod
    def of(cls, month: dt.date, now: dt.datetime | None = None) -> "ForecastWindow":
        now = now or timezone.now()
        today = local_today(now)
        following = month_after(month)
        days = settings.COSTS_FORECAST_DAYS
        return cls(
            month=month,
            last=following - dt.timedelta(days=1),
            days=days,
            since=today - dt.timedelta(days=days),
            until=today - dt.timedelta(days=1),
            days_left=Decimal((local_midnight(following) - now).total_seconds()) / 86400
            if month <= today < following
            else ZERO,
        )


@dataclass(frozen=True)
class SpendForecast:
    """A month's spend by its end: spent so far + the recent days' average × days left."""

    window: ForecastWindow
    spent: Decimal
    per_day: Decimal

    @property
    def amount(self) -> Decimal:
        return self.spent + self.per_day * self.window.days_left


def spend_forecast(
    source: RollUps,
    *,
    month: dt.date,
    idle_mode: str | None = None,
    spread_base: RollUps | None = None,
    now: dt.datetime | None = None,
) -> SpendForecast:
    """The forecast of the month for the same roll-ups (filters) and idle mode as a
    report, worked out as its total is (spend_total).
    `source` and `spread_base` are not cut to any days (the month and the window are read)."""
    window = ForecastWindow.of(month, now)

    def total(since: dt.date, until: dt.date) -> Decimal:
        return spend_total(
            source, since=since, until=until, idle_mode=idle_mode, spread_base=spread_base
        )

    spent = total(month, window.last)
    recent = total(window.since, window.until) if window.days_left else ZERO
    return SpendForecast(window=window, spent=spent, per_day=recent / window.days)


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

# Beside each id, what it names (a team's and a pool's slug, a node's, an instance type's
# and a job's name), blank once the row named is gone: the ledger keeps ids alone.
_NAMES = {
    "node_id": ("node", "name"),
    "pool_id": ("pool", "slug"),
    "instance_type_id": ("instance_type", "name"),
    "team_id": ("team", "slug"),
    "job_id": ("job", "name"),
}
_LEDGER_COLUMNS = [
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
USAGE_CSV_COLUMNS = [
    name
    for column in _LEDGER_COLUMNS
    for name in ((column, _NAMES[column][0]) if column in _NAMES else (column,))
]
_MONEY_COLUMNS = {"rate_per_hour", "amount", "savings"}
_TIME_COLUMNS = {"start", "end"}
_TEXT_COLUMNS = {"price_ref", "note", *(name for name, _ in _NAMES.values())}


def _named(column: str):
    """The model a ledger id refers to (through the loose reference: costs never imports
    jobs) and the field that names it."""
    name, field_name = _NAMES[column]
    return UsageEntry._meta.get_field(name).related_model, field_name


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

    raw = rows.order_by().values_list(*_LEDGER_COLUMNS)
    if connection.vendor == "postgresql":
        inner, params = raw.query.sql_with_params()
        bound = connection.ops.compose_sql(inner, params)

        names, joins = {}, []
        for column, (name, _) in _NAMES.items():
            model, field_name = _named(column)
            names[name] = f'"n_{name}"."{model._meta.get_field(field_name).column}"'
            joins.append(
                f'LEFT JOIN "{model._meta.db_table}" AS "n_{name}" '
                f'ON "n_{name}"."{model._meta.pk.column}" = e."{column}"'
            )

        def shown(column: str) -> str:
            value = names.get(column, f'e."{column}"')
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
            f"COPY (SELECT {select} FROM ({bound}) AS e {' '.join(joins)} "  # noqa: S608
            "ORDER BY e.day, e.id) "
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
    names = {}
    for column, (name, _) in _NAMES.items():
        model, field_name = _named(column)
        names[name] = Subquery(model.objects.filter(pk=OuterRef(column)).values(field_name)[:1])
    named = rows.order_by().annotate(**{f"named_{name}": value for name, value in names.items()})
    shown = [f"named_{c}" if c in names else c for c in USAGE_CSV_COLUMNS]
    for count, row in enumerate(named.values_list(*shown).order_by("day", "id").iterator(5000), 1):
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
