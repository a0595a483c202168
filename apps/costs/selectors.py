"""Reads for costs: the price book as rates, spend reports from the roll-ups, job costs and
projections, budget states (and the budget boundary the scheduler asks, with what each
burst will cost against it), banners.

Team roles see their own teams' spend only; idle capacity belongs to no team, so only
those who read every team (ops, finance) see it as such. Reports read the daily
roll-ups, never the ledger, so a month of any size is a few hundred rows.
"""

import datetime as dt
import logging
import time
import zoneinfo
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from functools import reduce

from django.conf import settings
from django.db.models import Max, Min, Q, QuerySet, Sum
from django.utils import timezone

from apps.accounts.models import Team
from apps.accounts.selectors import roles_of
from apps.costs import pricing
from apps.costs.models import (
    THRESHOLDS,
    Budget,
    BudgetAlert,
    CloudPrice,
    DailySpend,
    JobDailySpend,
    MeterMark,
    MonthlySpend,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
    UsageEntry,
)
from apps.costs.money import ZERO, money_text
from apps.fleet import cloud
from apps.fleet.models import (
    CapacityPreference,
    InstanceType,
    Node,
    NodeEvent,
    NodePool,
    NodeState,
    PoolKind,
)
from apps.fleet.models.nodes import CapacityType
from controlplane import webhooks
from controlplane.cache import best_effort

log = logging.getLogger(__name__)

CAPACITY_LABELS = dict(CapacityType.choices)
IDLE_LABEL = "idle"


def time_zone() -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(settings.COSTS_TIME_ZONE)


def local_today(now: dt.datetime | None = None) -> dt.date:
    return (now or timezone.now()).astimezone(time_zone()).date()


def month_start(now: dt.datetime | None = None) -> dt.date:
    return local_today(now).replace(day=1)


def month_after(first: dt.date) -> dt.date:
    return (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1)


def local_midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(0), tzinfo=time_zone())


# --- the price book, for a batch of nodes --------------------------------------------------


def owned_terms(price: OwnedPrice) -> pricing.OwnedTerms:
    """An owned price row's terms, as the pure rate functions take them."""
    return pricing.OwnedTerms(
        purchase_price=price.purchase_price,
        depreciation_months=price.depreciation_months,
        electricity_per_kwh=price.electricity_per_kwh,
        pue=price.pue,
        overhead_per_month=price.overhead_per_month,
        default_power_w=price.default_power_w,
    )


@dataclass(frozen=True)
class NodeRow:
    id: int
    pool_id: int
    instance_type_id: int | None
    capacity_type: str
    gpus: int
    billable_from: dt.datetime | None
    billable_until: dt.datetime | None
    power_w: int | None
    region: str

    @property
    def facts(self):
        from apps.costs.metering import NodeFacts

        return NodeFacts(
            node_id=self.id,
            pool_id=self.pool_id,
            instance_type_id=self.instance_type_id,
            capacity_type=self.capacity_type,
            gpus=self.gpus,
            billable_from=self.billable_from,
            billable_until=self.billable_until,
        )


@dataclass
class PriceBook:
    """The price book rows a batch of nodes needs, read in a few queries."""

    owned: dict = field(default_factory=lambda: defaultdict(list))
    cloud: dict = field(default_factory=lambda: defaultdict(list))
    discounts: dict = field(default_factory=lambda: defaultdict(list))
    spot: dict = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def read(cls, facts: list["NodeRow"], *, since: dt.datetime, until: dt.datetime):
        prices = cls()
        pools = {f.pool_id for f in facts}
        pairs = {(f.instance_type_id, f.region) for f in facts if f.instance_type_id}
        for price in OwnedPrice.objects.filter(pool_id__in=pools).order_by("effective_from"):
            prices.owned[price.pool_id].append((price.effective_from, price.pk, owned_terms(price)))
        types = {t for t, _ in pairs}
        for row in CloudPrice.objects.filter(instance_type_id__in=types).values_list(
            "instance_type_id", "region", "effective_from", "id", "per_hour"
        ):
            prices.cloud[(row[0], row[1])].append(row[2:])
        for row in PoolDiscount.objects.filter(pool_id__in=pools).values_list(
            "pool_id", "effective_from", "id", "percent"
        ):
            prices.discounts[row[0]].append(row[1:])
        spot_types = {f.instance_type_id for f in facts if f.capacity_type == CapacityType.SPOT}
        if spot_types:
            # Each zone's last price before the window, then every change inside it.
            latest = (
                SpotPrice.objects.filter(instance_type_id__in=spot_types, effective_at__lte=since)
                .values("instance_type_id", "availability_zone")
                .annotate(at=Max("effective_at"))
                .order_by()
            )
            wanted = Q(instance_type_id__in=spot_types, effective_at__gt=since) & Q(
                effective_at__lt=until
            )
            for last in latest:
                wanted |= Q(
                    instance_type_id=last["instance_type_id"],
                    availability_zone=last["availability_zone"],
                    effective_at=last["at"],
                )
            for type_id, region, at, zone, per_hour in SpotPrice.objects.filter(wanted).values_list(
                "instance_type_id", "region", "effective_at", "availability_zone", "per_hour"
            ):
                prices.spot[(type_id, region)].append((at, zone, per_hour))
        return prices

    def timeline(self, node: "NodeRow", power_w: int | None) -> pricing.Timeline:
        if node.capacity_type == CapacityType.OWNED:
            return pricing.owned_timeline(self.owned.get(node.pool_id, []), power_w)
        on_demand = pricing.on_demand_timeline(
            self.cloud.get((node.instance_type_id, node.region), []),
            self.discounts.get(node.pool_id, []),
        )
        if node.capacity_type == CapacityType.SPOT:
            return pricing.spot_timeline(
                self.spot.get((node.instance_type_id, node.region), []), on_demand, node.region
            )
        return on_demand


def node_rows(node_ids: list[int]) -> dict[int, NodeRow]:
    ends = dict(
        NodeEvent.objects.filter(node_id__in=node_ids, to_state=NodeState.TERMINATED)
        .values_list("node_id")
        .annotate(at=Min("at"))
        .order_by()
    )
    rows = {}
    for (
        node_id,
        pool_id,
        type_id,
        capacity,
        gpus,
        created_at,
        launched_at,
        measured,
        nameplate,
        region,
    ) in Node.objects.filter(pk__in=node_ids).values_list(
        "id",
        "pool_id",
        "instance_type_id",
        "capacity_type",
        "gpu_count",
        "created_at",
        "launched_at",
        "power_w",
        "nameplate_power_w",
        "pool__region",
    ):
        # Owned nodes cost from the moment they exist; cloud nodes from their launch.
        start = created_at if capacity == CapacityType.OWNED else launched_at
        rows[node_id] = NodeRow(
            id=node_id,
            pool_id=pool_id,
            instance_type_id=type_id,
            capacity_type=capacity,
            gpus=gpus,
            billable_from=start,
            billable_until=ends.get(node_id),
            power_w=measured or nameplate,
            region=region or "",
        )
    return rows


def rate_now(timeline: pricing.Timeline, at: dt.datetime) -> pricing.Rate:
    return pricing.value_at(timeline, at, pricing.UNPRICED)


# --- what pools cost, for projections ------------------------------------------------------


@dataclass(frozen=True)
class PoolRate:
    """What one GPU-hour of a pool costs now (low: spot where allowed; high: on-demand)."""

    pool_id: int
    pool: str
    low: Decimal
    high: Decimal
    gpus_per_node: int
    priced: bool


def pool_rates(*, pool_ids, spot_allowed: bool = False, at: dt.datetime | None = None):
    """Per GPU-hour rates of these pools now, from the price book (a few queries)."""
    at = at or timezone.now()
    pools = list(NodePool.objects.filter(pk__in=list(pool_ids)).prefetch_related("instance_types"))
    if not pools:
        return []
    owned_ids = [p.pk for p in pools if p.kind == PoolKind.OWNED]
    fleet_nodes: dict[int, list[tuple]] = defaultdict(list)
    for pool_id, gpus, measured, nameplate in (
        Node.objects.filter(pool_id__in=owned_ids)
        .exclude(state__in=(NodeState.TERMINATED, NodeState.FAILED))
        .values_list("pool_id", "gpu_count", "power_w", "nameplate_power_w")
    ):
        fleet_nodes[pool_id].append((gpus, measured or nameplate))
    facts = []
    for pool in pools:
        if pool.kind == PoolKind.OWNED:
            nodes = fleet_nodes.get(pool.pk) or [(8, None)]
            gpus = max(g for g, _ in nodes) or 8
            powers = [w for _, w in nodes if w]
            power = round(sum(powers) / len(powers)) if powers else None
            facts.append((pool, None, CapacityType.OWNED, gpus, power))
        else:
            types = sorted(pool.instance_types.all(), key=lambda t: t.gpu_count)
            for kind in [CapacityType.ON_DEMAND] + (
                [CapacityType.SPOT]
                if spot_allowed and pool.capacity_preference == "spot_then_on_demand"
                else []
            ):
                for itype in types:
                    facts.append((pool, itype, kind, itype.gpu_count, None))
    rows = [
        NodeRow(
            id=0,
            pool_id=pool.pk,
            instance_type_id=itype.pk if itype else None,
            capacity_type=kind,
            gpus=gpus,
            billable_from=None,
            billable_until=None,
            power_w=power,
            region=pool.region,
        )
        for pool, itype, kind, gpus, power in facts
    ]
    book = PriceBook.read(rows, since=at, until=at + dt.timedelta(seconds=1))
    by_pool: dict[int, list[Decimal]] = defaultdict(list)
    for row in rows:
        rate = rate_now(book.timeline(row, row.power_w), at)
        if rate is not pricing.UNPRICED and row.gpus:
            by_pool[row.pool_id].append(rate.per_hour / row.gpus)
    answer = []
    for pool in pools:
        per_gpu = by_pool.get(pool.pk)
        gpus = max((g for p, _, _, g, _ in facts if p.pk == pool.pk), default=8)
        answer.append(
            PoolRate(
                pool_id=pool.pk,
                pool=pool.slug,
                low=min(per_gpu) if per_gpu else ZERO,
                high=max(per_gpu) if per_gpu else ZERO,
                gpus_per_node=gpus,
                priced=bool(per_gpu),
            )
        )
    return answer


@dataclass(frozen=True)
class Projection:
    """A job's projected cost before placement: the cheapest and dearest eligible pool."""

    low: Decimal
    high: Decimal
    cheapest_pool: str
    per_gpu_hour: Decimal
    gpu_hours: Decimal


def projection_for(*, pool_ids, gpus: int, time_limit_s: int, spot_allowed: bool):
    """None when no eligible pool has a price."""
    priced = [r for r in pool_rates(pool_ids=pool_ids, spot_allowed=spot_allowed) if r.priced]
    if not priced:
        return None
    gpu_hours = Decimal(gpus) * Decimal(time_limit_s) / 3600
    cheapest = min(priced, key=lambda r: r.low)
    return Projection(
        low=cheapest.low * gpu_hours,
        high=max(r.high for r in priced) * gpu_hours,
        cheapest_pool=cheapest.pool,
        per_gpu_hour=cheapest.low,
        gpu_hours=gpu_hours,
    )


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
        names = dict(Team.objects.filter(pk__in=keys).values_list("id", "slug"))
        return {k: names.get(k, IDLE_LABEL if k == 0 else f"team {k}") for k in keys}
    if group_by == "pool":
        names = dict(NodePool.objects.filter(pk__in=keys).values_list("id", "slug"))
        return {k: names.get(k, f"pool {k}") for k in keys}
    if group_by == "instance_type":
        names = dict(InstanceType.objects.filter(pk__in=keys).values_list("id", "name"))
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


# --- budgets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetState:
    team_id: int
    team: str
    monthly_limit: Decimal
    spent: Decimal
    forecast: Decimal | None
    stop_submissions: bool
    webhook: bool
    month: dt.date

    @property
    def percent(self) -> Decimal:
        if not self.monthly_limit:
            return Decimal(100) if self.spent >= 0 else ZERO
        return self.spent * 100 / self.monthly_limit

    @property
    def crossed(self) -> list[int]:
        """The alert thresholds (percent of the limit) the spend has reached."""
        return [t for t in THRESHOLDS if self.spent >= self.monthly_limit * t / 100]

    @property
    def level(self) -> int:
        return max(self.crossed, default=0)

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.monthly_limit


def team_spend(*, since: dt.date, until: dt.date, team_ids=None) -> dict[int, Decimal]:
    rollups = rollups_between(since=since, until=until)
    if team_ids is not None:
        team_ids = list(team_ids)
        rollups = RollUps(
            daily=rollups.daily.filter(team_id__in=team_ids),
            monthly=rollups.monthly.filter(team_id__in=team_ids),
        )
    return {
        row["team_id"]: row["amount"]
        for row in rollups.sums(("team_id",), since=since, until=until)
        if row["team_id"] != 0
    }


def forecast_month(
    *, month: dt.date, team_ids=None, now: dt.datetime | None = None, fleet: bool = False
):
    """Spend to the month's end: spent so far + the average of the last COSTS_FORECAST_DAYS
    whole days × the days left. Per team ({team id: amount}), or with `fleet` for the whole
    fleet (one amount)."""
    now = now or timezone.now()
    today = local_today(now)
    following = month_after(month)
    last = following - dt.timedelta(days=1)
    days = settings.COSTS_FORECAST_DAYS
    window = (today - dt.timedelta(days=days), today - dt.timedelta(days=1))
    left = (
        Decimal((local_midnight(following) - now).total_seconds()) / 86400
        if month <= today < following
        else ZERO  # a past (or future) month: nothing left to forecast
    )
    if fleet:
        spent = fleet_cost(since=month, until=last)
        return spent + (fleet_cost(since=window[0], until=window[1]) / days * left if left else 0)
    spent = team_spend(since=month, until=last, team_ids=team_ids)
    recent = team_spend(since=window[0], until=window[1], team_ids=team_ids) if left else {}
    return {
        team_id: spent.get(team_id, ZERO) + recent.get(team_id, ZERO) / days * left
        for team_id in set(spent) | set(recent)
    }


def budget_states(
    *, month: dt.date | None = None, team_ids=None, forecast: bool = True
) -> list[BudgetState]:
    month = month or month_start()
    budgets = Budget.objects.select_related("team").order_by("team__slug")
    if team_ids is not None:
        budgets = budgets.filter(team_id__in=list(team_ids))
    budgets = list(budgets)
    if not budgets:
        return []
    ids = [b.team_id for b in budgets]
    spent = team_spend(since=month, until=month_after(month) - dt.timedelta(days=1), team_ids=ids)
    projected = forecast_month(month=month, team_ids=ids) if forecast else {}
    return [
        BudgetState(
            team_id=b.team_id,
            team=b.team.slug,
            monthly_limit=b.monthly_limit,
            spent=spent.get(b.team_id, ZERO),
            forecast=projected.get(b.team_id, spent.get(b.team_id, ZERO)) if forecast else None,
            stop_submissions=b.stop_submissions,
            webhook=bool(b.webhook_url),
            month=month,
        )
        for b in budgets
    ]


def budgets_visible_to(*, user) -> QuerySet[Budget]:
    return _of_visible_teams(Budget.objects.select_related("team"), user)


def budget_webhook_url_seen_by(*, budget: Budget, user) -> str:
    """The alert webhook's URL whole for who may set the budget (finance, the team's admins)
    and ops; for other members, without the credentials its user information and query may
    carry."""
    roles = roles_of(user)
    if roles.sees_every_team or roles.is_team_admin(budget.team_id):
        return budget.webhook_url
    return webhooks.redacted_url(budget.webhook_url)


def budget_alerts_visible_to(*, user) -> QuerySet[BudgetAlert]:
    return _of_visible_teams(BudgetAlert.objects.select_related("team"), user)


# The budget boundary: read on every scheduling pass for every team with pending jobs,
# so every team's budget and spend this month are read in one go and kept for
# COSTS_BUDGET_CACHE_S (and forgotten at once when this process changes a budget, a price
# or the ledger). A pass asks for each of a thousand teams: a fresh answer costs two clock
# readings, not a time-zone conversion (the month's end is kept as a timestamp).
_out_of_budget: dict = {
    "read_at": float("-inf"),
    "month_ends": float("-inf"),
    "teams": frozenset(),  # the teams whose spend has reached their budget
    "budgets": {},  # team id -> BudgetState, for the teams with a budget
}


def forget_budget_state() -> None:
    _out_of_budget["read_at"] = float("-inf")


def _budget_boundary() -> dict:
    kept = _out_of_budget
    if (
        time.monotonic() - kept["read_at"] < settings.COSTS_BUDGET_CACHE_S
        and time.time() < kept["month_ends"]
    ):
        return kept
    month = month_start()
    states = budget_states(month=month, forecast=False)
    ends = dt.datetime.combine(month_after(month), dt.time(), tzinfo=time_zone()).timestamp()
    kept.update(
        read_at=time.monotonic(),
        month_ends=ends,
        teams=frozenset(s.team_id for s in states if s.exhausted),
        budgets={s.team_id: s for s in states},
    )
    return kept


def teams_out_of_budget() -> frozenset[int]:
    return _budget_boundary()["teams"]


def team_within_budget(*, team_id: int) -> bool:
    """False once the team's spend this month reached its budget (100%): no cloud bursts."""
    return team_id not in teams_out_of_budget()


# --- what a burst will cost, against its team's budget ---------------------------------------


@dataclass(frozen=True)
class BurstPrice:
    """What a node of a burst would cost: the pool's instance type for it, spot or not."""

    pool: str
    instance_type: str
    capacity_type: str
    per_node_hour: Decimal | None  # None: the price book has no price for it
    node_gpus: int


def burst_prices(*, wants, at: dt.datetime | None = None) -> dict[tuple, BurstPrice | None]:
    """{(pool id, GPUs per node, spot): its price now}, None for a pool that is gone or has
    no instance type that big. Spot is priced as metering will price it (the dearest
    zone, or on-demand while no spot price is known). A few queries for any number."""
    at = at or timezone.now()
    wants = set(wants)
    pools = NodePool.objects.prefetch_related("instance_types").in_bulk({w[0] for w in wants})
    nodes: dict[tuple, NodeRow | None] = {}
    for key in wants:
        pool_id, gpus_per_node, spot = key
        pool = pools.get(pool_id)
        itype = None if pool is None else cloud.burst_instance_type(pool, gpus_per_node)
        if itype is None:
            nodes[key] = None
            continue
        spot = spot and pool.capacity_preference == CapacityPreference.SPOT_THEN_ON_DEMAND
        nodes[key] = NodeRow(
            id=0,
            pool_id=pool.pk,
            instance_type_id=itype.pk,
            capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND,
            gpus=itype.gpu_count,
            billable_from=None,
            billable_until=None,
            power_w=None,
            region=pool.region or "",
        )
    known = [n for n in nodes.values() if n is not None]
    book = PriceBook.read(known, since=at, until=at + dt.timedelta(seconds=1))
    types = {t.pk: t.name for pool in pools.values() for t in pool.instance_types.all()}
    prices: dict[tuple, BurstPrice | None] = {}
    for key, node in nodes.items():
        if node is None:
            prices[key] = None
            continue
        rate = rate_now(book.timeline(node, None), at)
        prices[key] = BurstPrice(
            pool=pools[node.pool_id].slug,
            instance_type=types[node.instance_type_id],
            capacity_type=node.capacity_type,
            per_node_hour=None if rate is pricing.UNPRICED else rate.per_hour,
            node_gpus=node.gpus,
        )
    return prices


@dataclass(frozen=True)
class BurstCost:
    """A cloud burst the scheduler would ask for: whose, where, and how big and long."""

    job_id: int
    team_id: int
    pool_id: int
    spot: bool
    nodes: int
    gpus_per_node: int
    time_limit_s: int
    max_cost: Decimal | None = None  # the job's max_cost_usd


@dataclass(frozen=True)
class BurstVerdict:
    allowed: bool
    projected: Decimal | None  # None: no budget to hold it against, or no price known
    reason: str = ""  # why not, in words for the job's waiting reason


def bursts_within_budget(*, bursts, at: dt.datetime | None = None) -> dict[int, BurstVerdict]:
    """{job id: verdict} for a scheduling pass's bursts, in the order given (the queue's).

    A burst goes only if its team's spend this month, plus the projected cost of the
    bursts allowed before it in this pass, plus its own projected cost
    (pricing.burst_cost) stays within the team's budget. A team without a budget bursts
    freely, and its bursts are not even priced. A burst whose price is unknown (no price
    in the book, or no instance type that fits) and that has no max_cost_usd to bound it
    is refused: what it would cost cannot be held against the budget, and metering would
    count it as free."""
    bursts = list(bursts)
    budgets = _budget_boundary()["budgets"]
    held = [b for b in bursts if b.team_id in budgets]
    verdicts = {b.job_id: BurstVerdict(allowed=True, projected=None) for b in bursts}
    if not held:
        return verdicts
    prices = burst_prices(wants={(b.pool_id, b.gpus_per_node, b.spot) for b in held}, at=at)
    committed: dict[int, Decimal] = defaultdict(lambda: ZERO)
    for burst in held:
        budget = budgets[burst.team_id]
        price = prices[(burst.pool_id, burst.gpus_per_node, burst.spot)]
        projected = pricing.burst_cost(
            gpus=burst.nodes * burst.gpus_per_node,
            time_limit_s=burst.time_limit_s,
            per_node_hour=None if price is None else price.per_node_hour,
            node_gpus=0 if price is None else price.node_gpus,
            max_cost=burst.max_cost,
        )
        left = budget.monthly_limit - budget.spent - committed[burst.team_id]
        if projected is None:
            verdicts[burst.job_id] = BurstVerdict(
                allowed=False, projected=None, reason=_unpriced_reason(burst, price, budget)
            )
            _warn_unpriced(burst, price)
        elif projected > left:
            verdicts[burst.job_id] = BurstVerdict(
                allowed=False,
                projected=projected,
                reason=_over_budget_reason(burst, price, budget, projected, left),
            )
        else:
            committed[burst.team_id] += projected
            verdicts[burst.job_id] = BurstVerdict(allowed=True, projected=projected)
    return verdicts


def _burst_words(burst: BurstCost, price: BurstPrice | None) -> str:
    """'2 × 8 GPUs for 10 h on aws-p5 (p5.48xlarge, spot)'."""
    if burst.nodes == 1:
        gpus = f"{burst.gpus_per_node} GPUs"
    else:
        gpus = f"{burst.nodes} × {burst.gpus_per_node} GPUs"
    if price is None:
        where = f"cloud pool {burst.pool_id}"
    else:
        capacity = CAPACITY_LABELS[price.capacity_type].lower()
        where = f"{price.pool} ({price.instance_type}, {capacity})"
    return f"{gpus} for {burst.time_limit_s / 3600:g} h on {where}"


def _over_budget_reason(burst, price, budget: BudgetState, projected, left) -> str:
    return (
        f"no cloud burst: {_burst_words(burst, price)} could cost "
        f"{money_text(projected)}, and team {budget.team} has "
        f"{money_text(max(left, ZERO))} of its {money_text(budget.monthly_limit)} "
        f"budget left this month"
    )


def _unpriced_reason(burst, price, budget: BudgetState) -> str:
    missing = "no instance type that fits" if price is None else "no price in the price book"
    return (
        f"no cloud burst: {_burst_words(burst, price)} has {missing}, so its cost "
        f"cannot be held against team {budget.team}'s budget"
    )


def _warn_unpriced(burst: BurstCost, price: BurstPrice | None) -> None:
    """Once per pool and kind every ten minutes, not on every pass."""
    if price is None:
        return  # the fleet's burst request says so itself
    key = f"costs:burst-unpriced:{burst.pool_id}:{price.instance_type}:{price.capacity_type}"
    if best_effort.add(key, 1, timeout=600):
        log.warning(
            "no price for %s %s in pool %s: bursts of teams with a budget are refused",
            price.instance_type,
            price.capacity_type,
            price.pool,
        )


def submissions_refused(*, team_id: int) -> BudgetState | None:
    """The team's budget state when it is spent and set to refuse new jobs, else None."""
    if team_within_budget(team_id=team_id):
        return None
    state = next(iter(budget_states(team_ids=[team_id], forecast=False)), None)
    return state if state is not None and state.stop_submissions else None


def alert_payload(alert: BudgetAlert) -> dict:
    return {
        "team": alert.team.slug,
        "team_id": alert.team_id,
        "month": f"{alert.month:%Y-%m}",
        "threshold_percent": alert.threshold,
        "spent": str(alert.spent.quantize(Decimal("0.01"))),
        "monthly_limit": str(alert.monthly_limit),
        "currency": settings.COSTS_CURRENCY,
        "at": alert.at.isoformat(),
    }


def banners_for(*, user) -> list[dict]:
    """This month's highest alert of each of the user's teams (members see their teams')."""
    roles = roles_of(user)
    if not roles.team_ids:
        return []
    month = month_start()
    latest: dict[int, BudgetAlert] = {}
    for alert in BudgetAlert.objects.filter(month=month, team_id__in=roles.team_ids).select_related(
        "team"
    ):
        if alert.team_id not in latest or alert.threshold > latest[alert.team_id].threshold:
            latest[alert.team_id] = alert
    return [
        {
            "team": alert.team.slug,
            "team_id": alert.team_id,
            "threshold": alert.threshold,
            "level": "error" if alert.threshold >= 100 else "warning",
            "text": (
                f"Team {alert.team.slug} has spent {alert.threshold}% or more of its "
                f"{money_text(alert.monthly_limit)} budget for {alert.month:%B %Y}"
                + (": its jobs no longer burst to the cloud." if alert.threshold >= 100 else ".")
            ),
        }
        for alert in sorted(latest.values(), key=lambda a: a.team.slug)
    ]


# --- the price book, for pages and the API --------------------------------------------------


@dataclass(frozen=True)
class OwnedPriceView:
    price: OwnedPrice
    rate: pricing.OwnedRate
    per_gpu_hour: Decimal
    gpus: int


def owned_prices() -> list[OwnedPriceView]:
    """Each owned price with its rate worked out for a typical node of the pool."""
    prices = list(owned_price_rows())
    power: dict[int, list[int]] = defaultdict(list)
    gpus: dict[int, int] = {}
    for pool_id, count, measured, nameplate in Node.objects.filter(
        pool_id__in={p.pool_id for p in prices}
    ).values_list("pool_id", "gpu_count", "power_w", "nameplate_power_w"):
        gpus[pool_id] = max(gpus.get(pool_id, 0), count)
        if measured or nameplate:
            power[pool_id].append(measured or nameplate)
    views = []
    for price in prices:
        watts = power.get(price.pool_id)
        rate = pricing.owned_rate(
            owned_terms(price), round(sum(watts) / len(watts)) if watts else None
        )
        count = gpus.get(price.pool_id) or 8
        views.append(
            OwnedPriceView(price=price, rate=rate, per_gpu_hour=rate.per_hour / count, gpus=count)
        )
    return views


def spot_prices_latest(*, limit: int = 50) -> list[SpotPrice]:
    """Each zone's newest spot price per instance type."""
    newest = (
        SpotPrice.objects.values("instance_type_id", "availability_zone")
        .annotate(at=Max("effective_at"))
        .order_by()
    )
    wanted = [
        Q(
            instance_type_id=n["instance_type_id"],
            availability_zone=n["availability_zone"],
            effective_at=n["at"],
        )
        for n in newest[:limit]
    ]
    if not wanted:
        return []
    return list(
        SpotPrice.objects.filter(reduce(lambda a, b: a | b, wanted))
        .select_related("instance_type")
        .order_by("instance_type__name", "availability_zone")
    )


def owned_price_rows() -> QuerySet[OwnedPrice]:
    return OwnedPrice.objects.select_related("pool").order_by("pool__slug", "-effective_from")


def cloud_prices() -> QuerySet[CloudPrice]:
    return CloudPrice.objects.select_related("instance_type").order_by(
        "instance_type__name", "region", "-effective_from"
    )


def pool_discounts() -> QuerySet[PoolDiscount]:
    return PoolDiscount.objects.select_related("pool").order_by("pool__slug", "-effective_from")


def unpriced_pools() -> list[str]:
    """Pools some of whose nodes have no price in the book (they are metered at zero)."""
    missing = []
    owned = set(OwnedPrice.objects.values_list("pool_id", flat=True))
    listed = set(CloudPrice.objects.values_list("instance_type_id", "region"))
    for pool in NodePool.objects.prefetch_related("instance_types").order_by("slug"):
        if pool.kind == PoolKind.OWNED:
            if pool.pk not in owned and pool.nodes.exists():
                missing.append(pool.slug)
        elif any((t.pk, pool.region) not in listed for t in pool.instance_types.all()):
            missing.append(pool.slug)
    return missing


def metered_until() -> dt.datetime | None:
    """How far metering has got over the nodes still costing."""
    return MeterMark.objects.filter(closed=False).aggregate(at=Min("metered_until"))["at"]


def spot_price_targets() -> list[tuple[str, str, dt.datetime | None]]:
    """(region, instance type, newest spot price stored) for every enabled cloud pool that
    may launch spot: what the spot price task asks EC2 about."""
    pools = NodePool.objects.filter(
        kind=PoolKind.CLOUD, enabled=True, capacity_preference="spot_then_on_demand"
    ).prefetch_related("instance_types")
    pairs = {(p.region, t.name, t.pk) for p in pools for t in p.instance_types.all()}
    newest = {
        (type_id, region): at
        for type_id, region, at in SpotPrice.objects.values_list("instance_type_id", "region")
        .annotate(at=Max("effective_at"))
        .order_by()
    }
    return sorted((region, name, newest.get((type_id, region))) for region, name, type_id in pairs)


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
