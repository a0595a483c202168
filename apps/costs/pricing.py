"""Rates from the price book, as pure functions over plain data (no ORM).

A node's rate is a step function of time (a timeline): each price row, discount or
spot price starts a step at its effective time. Rates are per node-hour, rounded to
10⁻⁶ of the currency (the precision of EC2's spot prices): the "rate in force".

Owned nodes (per node-hour):

    amortised = purchase_price / (depreciation_months × 730)
    power     = power_w / 1000 × pue × electricity_per_kwh
    overhead  = overhead_per_month / 730
    rate      = amortised + power + overhead          (730 h = 8,760 h / 12 months)

Cloud nodes: on-demand = list price × (1 − the pool's discount); spot = the highest
spot price among the region's availability zones at that instant (the node's zone is
not recorded, so never under-counted), or the on-demand rate while no spot price is
known. A spot row also carries the on-demand rate, for the savings.

A cloud burst is projected before it is asked for, to hold it against its team's budget:
its GPUs × its time limit × the per-GPU share of the rate of the node it would get.
"""

import bisect
import datetime as dt
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

HOURS_PER_MONTH = Decimal(730)
RATE_QUANTUM = Decimal("0.000001")
ZERO = Decimal(0)


def _rate(value: Decimal) -> Decimal:
    return value.quantize(RATE_QUANTUM, rounding=ROUND_HALF_EVEN)


@dataclass(frozen=True)
class OwnedTerms:
    purchase_price: Decimal
    depreciation_months: int
    electricity_per_kwh: Decimal
    pue: Decimal
    overhead_per_month: Decimal
    default_power_w: int


@dataclass(frozen=True)
class OwnedRate:
    """An owned node's rate and its parts, per node-hour (the formula, shown on the page)."""

    amortised: Decimal
    power: Decimal
    overhead: Decimal
    per_hour: Decimal
    power_w: int


def owned_rate(terms: OwnedTerms, power_w: int | None) -> OwnedRate:
    watts = power_w if power_w else terms.default_power_w
    amortised = terms.purchase_price / (terms.depreciation_months * HOURS_PER_MONTH)
    power = Decimal(watts) / 1000 * terms.pue * terms.electricity_per_kwh
    overhead = terms.overhead_per_month / HOURS_PER_MONTH
    return OwnedRate(
        amortised=_rate(amortised),
        power=_rate(power),
        overhead=_rate(overhead),
        per_hour=_rate(amortised + power + overhead),
        power_w=watts,
    )


def discounted(list_price: Decimal, percent: Decimal) -> Decimal:
    return _rate(list_price * (100 - percent) / 100)


@dataclass(frozen=True)
class Rate:
    """The rate in force over a step of a node's timeline."""

    per_hour: Decimal
    ref: str  # which price rows: "owned:3", "cloud:7-15%:2", "spot:us-east-1", "unpriced"
    on_demand: Decimal | None = None  # spot steps: the on-demand rate at the same time
    power_w: int | None = None


UNPRICED = Rate(per_hour=ZERO, ref="unpriced")

# A timeline: (start, value) steps sorted by start; a value holds until the next start.
Timeline = list[tuple[dt.datetime, object]]


def steps(points: Sequence[tuple[dt.datetime, object]]) -> Timeline:
    """Sorted by time; of two steps at the same instant the later one given wins."""
    by_time: dict[dt.datetime, object] = {}
    for at, value in points:
        by_time[at] = value
    return sorted(by_time.items(), key=lambda step: step[0])


def value_at(timeline: Timeline, at: dt.datetime, default=None):
    starts = [t for t, _ in timeline]
    i = bisect.bisect_right(starts, at) - 1
    return timeline[i][1] if i >= 0 else default


def combine(timelines: Sequence[Timeline], make: Callable[..., object], defaults=None) -> Timeline:
    """One timeline from several: a step wherever any of them steps, valued by `make`."""
    defaults = defaults or [None] * len(timelines)
    moments = sorted({t for timeline in timelines for t, _ in timeline})
    return steps(
        (t, make(*(value_at(tl, t, d) for tl, d in zip(timelines, defaults, strict=True))))
        for t in moments
    )


def owned_timeline(prices: Sequence[tuple[dt.datetime, int, OwnedTerms]], power_w) -> Timeline:
    """prices: (effective_from, price id, terms) of the node's pool."""
    out = []
    for at, price_id, terms in prices:
        rate = owned_rate(terms, power_w)
        out.append(
            (at, Rate(per_hour=rate.per_hour, ref=f"owned:{price_id}", power_w=rate.power_w))
        )
    return steps(out)


def on_demand_timeline(
    list_prices: Sequence[tuple[dt.datetime, int, Decimal]],
    discounts: Sequence[tuple[dt.datetime, int, Decimal]] = (),
) -> Timeline:
    """list_prices: (effective_from, id, per hour); discounts: (effective_from, id, percent)."""
    prices = steps((at, (pid, per_hour)) for at, pid, per_hour in list_prices)
    cuts = steps((at, (did, percent)) for at, did, percent in discounts)

    def make(price, cut):
        if price is None:
            return UNPRICED
        price_id, per_hour = price
        if cut is None or not cut[1]:
            return Rate(per_hour=_rate(per_hour), ref=f"cloud:{price_id}")
        discount_id, percent = cut
        return Rate(
            per_hour=discounted(per_hour, percent),
            ref=f"cloud:{price_id}-{percent.normalize():f}%:{discount_id}",
        )

    return combine([prices, cuts], make)


def spot_timeline(
    spot_prices: Sequence[tuple[dt.datetime, str, Decimal]], on_demand: Timeline, region: str
) -> Timeline:
    """spot_prices: (effective_at, availability zone, per hour) of one instance type and
    region, each in force in its zone until that zone's next entry."""
    zones: dict[str, list[tuple[dt.datetime, Decimal]]] = {}
    for at, zone, per_hour in spot_prices:
        zones.setdefault(zone, []).append((at, per_hour))
    zone_timelines = [steps(points) for points in zones.values()]

    def make(on_demand_rate, *zone_prices):
        known = [p for p in zone_prices if p is not None]
        reference = None if on_demand_rate in (None, UNPRICED) else on_demand_rate.per_hour
        if not known:
            if reference is None:
                return UNPRICED
            return Rate(
                per_hour=reference, ref="spot-unknown:" + on_demand_rate.ref, on_demand=reference
            )
        return Rate(per_hour=_rate(max(known)), ref=f"spot:{region}", on_demand=reference)

    return combine([on_demand, *zone_timelines], make)


def burst_cost(
    *,
    gpus: int,
    time_limit_s: int,
    per_node_hour: Decimal | None,
    node_gpus: int,
    max_cost: Decimal | None = None,
) -> Decimal | None:
    """The most a burst can cost: its GPUs for the whole of its time limit at the node's
    rate shared out per GPU, or the job's own cost limit if that is lower (the job is
    stopped there). None when neither is known.

    Worked out exactly (a rate shared by 3 GPUs, a limit of 7 s, are no finite decimals)
    and rounded up to 10⁻⁹, so a budget is never shown to hold what it does not."""
    bounds = []
    if per_node_hour is not None and node_gpus > 0:
        exact = Fraction(per_node_hour) * gpus * time_limit_s / (node_gpus * 3600)
        bounds.append(Decimal(math.ceil(exact * 10**9)).scaleb(-9))
    if max_cost is not None:
        bounds.append(max_cost)
    return min(bounds) if bounds else None
