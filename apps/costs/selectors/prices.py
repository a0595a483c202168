"""The price book as rates: for a batch of nodes, for projections, for pages and the API."""

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from functools import reduce

from django.db.models import Max, Min, Q, QuerySet
from django.utils import timezone

from apps.costs import pricing
from apps.costs.models import (
    CloudPrice,
    MeterMark,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
)
from apps.costs.money import ZERO
from apps.fleet import selectors as fleet
from apps.fleet.models import PoolKind
from apps.fleet.models.nodes import CapacityType

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
class NodeRow(fleet.NodeBilling):
    """A node as the meter prices it."""

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
    return {n.id: NodeRow(**vars(n)) for n in fleet.nodes_billing(node_ids=node_ids)}


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
    pools = list(fleet.pools_with_instance_types(pool_ids=pool_ids).values())
    if not pools:
        return []
    owned_ids = [p.pk for p in pools if p.kind == PoolKind.OWNED]
    fleet_nodes: dict[int, list[tuple]] = defaultdict(list)
    for pool_id, gpus, watts in fleet.pool_node_sizes(pool_ids=owned_ids, live_only=True):
        fleet_nodes[pool_id].append((gpus, watts))
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
    for pool_id, count, watts in fleet.pool_node_sizes(pool_ids={p.pool_id for p in prices}):
        gpus[pool_id] = max(gpus.get(pool_id, 0), count)
        if watts:
            power[pool_id].append(watts)
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
    pools = fleet.pools_with_instance_types().values()
    unpriced = [p.pk for p in pools if p.kind == PoolKind.OWNED and p.pk not in owned]
    with_nodes = fleet.pools_with_nodes(pool_ids=unpriced) if unpriced else set()
    for pool in pools:
        if pool.kind == PoolKind.OWNED:
            if pool.pk not in owned and pool.pk in with_nodes:
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
    pools = fleet.spot_capable_pools()
    pairs = {(p.region, t.name, t.pk) for p in pools for t in p.instance_types.all()}
    newest = {
        (type_id, region): at
        for type_id, region, at in SpotPrice.objects.values_list("instance_type_id", "region")
        .annotate(at=Max("effective_at"))
        .order_by()
    }
    return sorted((region, name, newest.get((type_id, region))) for region, name, type_id in pairs)
