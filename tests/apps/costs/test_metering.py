"""Cost truth: the ledger against the fleet's cost worked out independently, price changes,
spot prices, shared nodes, days in the time zone, and a metering run killed half-way."""

import datetime as dt
import itertools
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

import pytest
from django.db import transaction
from django.db.models import Sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.costs import services
from apps.costs.models import (
    CloudPrice,
    DailySpend,
    JobDailySpend,
    MeterMark,
    MonthlySpend,
    UsageEntry,
)
from apps.costs.money import NANOS, to_nanos
from apps.costs.services import ledger
from apps.fleet.models import Node
from tests.apps.costs.conftest import (
    Allocations,
    at,
    cloud_node,
    cloud_pool,
    cloud_price,
    discount,
    meter,
    owned_node,
    owned_pool,
    owned_price,
    spot_price,
    terminate,
)

pytestmark = pytest.mark.django_db

RATE = Decimal("0.000001")
HOUR = 3600


def nanos_of(rows) -> int:
    return sum(to_nanos(r.amount) for r in rows)


def ledger_nanos(**filters) -> int:
    return nanos_of(UsageEntry.objects.filter(**filters))


# --- the fleet's cost, worked out on its own: uptime × the price in force ----------------------


def _latest(steps, moment):
    """The value of the last (start, value) step at or before `moment`, or None."""
    value = None
    for start, v in sorted(steps, key=lambda s: s[0]):
        if start <= moment:
            value = v
    return value


def owned_rate_by_hand(terms: dict, watts: int) -> Fraction:
    per_hour = (
        Fraction(terms["purchase_price"]) / (terms["depreciation_months"] * 730)
        + Fraction(watts, 1000) * Fraction(terms["pue"]) * Fraction(terms["electricity_per_kwh"])
        + Fraction(terms["overhead_per_month"]) / 730
    )
    rounded = Decimal(per_hour.numerator) / Decimal(per_hour.denominator)
    return Fraction(rounded.quantize(RATE, rounding=ROUND_HALF_EVEN))


def rate_by_hand(kind, moment, *, owned=(), listed=(), cuts=(), zones=None, watts=10000):
    if kind == "owned":
        terms = _latest(owned, moment)
        return Fraction(0) if terms is None else owned_rate_by_hand(terms, watts)
    price = _latest(listed, moment)
    cut = _latest(cuts, moment) or Decimal(0)
    on_demand = (
        Fraction(0)
        if price is None
        else Fraction((price * (100 - cut) / 100).quantize(RATE, rounding=ROUND_HALF_EVEN))
    )
    if kind == "on_demand":
        return on_demand
    known = [_latest(steps, moment) for steps in (zones or {}).values()]
    known = [p for p in known if p is not None]
    return Fraction(max(known)) if known else on_demand


def cost_by_hand(kind, *, start, end, **prices) -> Fraction:
    """∫ rate dt over [start, end), cut at every price change (exact)."""
    moments = {start, end}
    for steps in [
        prices.get("owned", ()),
        prices.get("listed", ()),
        prices.get("cuts", ()),
        *list((prices.get("zones") or {}).values()),
    ]:
        moments.update(t for t, _ in steps if start < t < end)
    moments = sorted(moments)
    total = Fraction(0)
    for a, b in itertools.pairwise(moments):
        seconds = Fraction((b - a) // dt.timedelta(microseconds=1), 1_000_000)
        total += rate_by_hand(kind, a, **prices) * seconds / HOUR
    return total


# --- the property ------------------------------------------------------------------------------

OFFSETS = st.integers(min_value=0, max_value=60 * HOUR)
MONEY = st.decimals(min_value=Decimal("0.5"), max_value=Decimal("120"), places=4)


def moment(seconds: int, micros: int = 0) -> dt.datetime:
    return at(0) + dt.timedelta(seconds=seconds, microseconds=micros)


node_plans = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["owned", "on_demand", "spot"]),
        "gpus": st.sampled_from([8, 4]),
        "start": OFFSETS,
        "life": st.one_of(st.none(), st.integers(min_value=1, max_value=40 * HOUR)),
        "holds": st.lists(
            st.tuples(
                st.integers(1, 4),  # job
                st.integers(1, 8),  # GPUs
                OFFSETS,
                st.one_of(st.none(), st.integers(1, 30 * HOUR)),
                st.integers(0, 999_999),  # microseconds: allocations start at any instant
            ),
            max_size=4,
        ),
    }
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plans=st.lists(node_plans, min_size=1, max_size=3),
    purchase=st.lists(st.tuples(OFFSETS, MONEY), min_size=1, max_size=3),
    listed=st.lists(st.tuples(OFFSETS, MONEY), min_size=1, max_size=3),
    cut=st.one_of(st.none(), st.tuples(OFFSETS, st.decimals(0, 40, places=2))),
    zones=st.lists(st.tuples(st.sampled_from("ab"), OFFSETS, MONEY), max_size=4),
    runs=st.lists(st.integers(1, 72 * HOUR), min_size=1, max_size=4),
)
def test_job_costs_plus_idle_equal_the_fleets_cost_from_uptime_and_prices(
    plans, purchase, listed, cut, zones, runs
):
    horizon = moment(72 * HOUR)
    with transaction.atomic():
        owned, cloud = owned_pool("prop-owned"), cloud_pool("prop-cloud")
        owned_steps = []
        for offset, money in purchase:
            terms = {
                "purchase_price": (money * 1000).quantize(Decimal("0.01")),
                "depreciation_months": 36,
                "electricity_per_kwh": Decimal("0.1"),
                "pue": Decimal("1.2"),
                "overhead_per_month": Decimal("500"),
            }
            if moment(offset) in {t for t, _ in owned_steps}:
                continue
            owned_price(owned, since=moment(offset), **terms)
            owned_steps.append((moment(offset), terms))
        # The price book starts with the seeded p5.48xlarge row (a data migration).
        listed_steps = list(
            CloudPrice.objects.filter(region="us-east-1").values_list("effective_from", "per_hour")
        )
        for offset, money in listed:
            if moment(offset) in {t for t, _ in listed_steps}:
                continue
            cloud_price(money, since=moment(offset))
            listed_steps.append((moment(offset), money))
        cut_steps = []
        if cut is not None:
            discount(cloud, cut[1], since=moment(cut[0]))
            cut_steps.append((moment(cut[0]), cut[1]))
        zone_steps: dict[str, list] = {}
        for zone, offset, money in zones:
            name = f"us-east-1{zone}"
            if moment(offset) in {t for t, _ in zone_steps.get(name, [])}:
                continue
            spot_price(money, when=moment(offset), zone=name)
            zone_steps.setdefault(name, []).append((moment(offset), money))

        allocations = Allocations()
        nodes = []
        for plan in plans:
            start = moment(plan["start"])
            end = None if plan["life"] is None else start + dt.timedelta(seconds=plan["life"])
            if plan["kind"] == "owned":
                node = owned_node(owned, since=start, gpus=plan["gpus"], power_w=9000)
            else:
                node = cloud_node(cloud, launched=start, capacity=plan["kind"])
                Node.objects.filter(pk=node.pk).update(gpu_count=plan["gpus"])
            if end is not None:
                terminate(node, end)
            for job, gpus, offset, length, micros in plan["holds"]:
                begin = moment(offset, micros)
                finish = None if length is None else begin + dt.timedelta(seconds=length)
                allocations.add(node, job, 10 + job % 2, gpus, begin, finish)
            nodes.append((node, plan["kind"], start, end))

        for cut_at in sorted(set(runs)):
            meter(allocations, until=min(moment(cut_at), horizon))
        meter(allocations, until=horizon)

        fleet_exact = Fraction(0)
        for node, kind, start, end in nodes:
            exact = cost_by_hand(
                kind,
                start=min(start, horizon),
                end=min(end or horizon, horizon),
                owned=owned_steps,
                listed=listed_steps,
                cuts=cut_steps,
                zones=zone_steps,
                watts=9000,
            )
            booked = ledger_nanos(node_id=node.pk)
            # Booked once per node to the nano-unit: never more than half of one away.
            assert abs(booked - exact * NANOS) <= Fraction(1, 2)
            fleet_exact += exact
            jobs = ledger_nanos(node_id=node.pk, job__isnull=False)
            idle = ledger_nanos(node_id=node.pk, job__isnull=True)
            assert jobs + idle == booked
        total = ledger_nanos()
        assert abs(total - fleet_exact * NANOS) <= Fraction(len(nodes), 2)
        # ...so to the cent as well, and the roll-ups hold exactly what the ledger holds.
        rollups = DailySpend.objects.aggregate(t=Sum("amount"))["t"] or Decimal(0)
        assert to_nanos(rollups) == total
        months = MonthlySpend.objects.aggregate(t=Sum("amount"))["t"] or Decimal(0)
        assert to_nanos(months) == total
        job_rollups = JobDailySpend.objects.aggregate(t=Sum("amount"))["t"] or Decimal(0)
        assert to_nanos(job_rollups) == ledger_nanos(job__isnull=False)
        transaction.set_rollback(True)


# --- examples ---------------------------------------------------------------------------------


def test_a_shared_node_is_split_by_the_gpus_each_job_holds_and_the_rest_is_idle():
    pool = owned_pool()
    node = owned_node(pool, power_w=10000)
    owned_price(pool)  # 12.121644 a node-hour (see conftest's terms)
    allocations = Allocations()
    allocations.add(node, 1, 7, 4, at(0), at(2))
    allocations.add(node, 2, 8, 2, at(1), at(2))

    meter(allocations, until=at(2))

    rate = Decimal("12.121644")
    by_job = dict(UsageEntry.objects.values_list("job_id").annotate(s=Sum("amount")).order_by())
    assert by_job[1] == rate * 2 * 4 / 8
    assert by_job[2] == rate * 1 * 2 / 8
    assert by_job[None] == rate * 2 - by_job[1] - by_job[2]  # 4 GPUs, then 2, idle
    assert sorted(UsageEntry.objects.filter(job__isnull=True).values_list("gpus", flat=True)) == [
        2,
        4,
    ]


def test_the_owned_rate_is_amortisation_plus_power_plus_overhead():
    pool = owned_pool()
    measured = owned_node(pool, power_w=8000)
    Node.objects.filter(pk=measured.pk).update(power_w=6500)  # heartbeats' draw wins
    nameplate = owned_node(pool, power_w=8000)
    neither = owned_node(pool)
    owned_price(pool, default_power_w=10000)

    meter(until=at(1))

    def rate(node):
        return UsageEntry.objects.get(node=node).rate_per_hour

    amortised, overhead = Decimal(300000) / (48 * 730), Decimal(1460) / 730
    for node, watts in ((measured, 6500), (nameplate, 8000), (neither, 10000)):
        power = Decimal(watts) / 1000 * Decimal("1.3") * Decimal("0.12")
        assert rate(node) == (amortised + power + overhead).quantize(RATE)
        assert UsageEntry.objects.get(node=node).power_w == watts


def test_a_price_change_at_an_effective_time_splits_the_interval():
    pool = cloud_pool()
    node = cloud_node(pool)
    cloud_price("55.04")
    cloud_price("40.00", since=at(1.5))
    discount(pool, "10", since=at(2.25))

    meter(until=at(3))

    rows = list(UsageEntry.objects.order_by("start").values_list("start", "end", "rate_per_hour"))
    assert rows == [
        (at(0), at(1.5), Decimal("55.04")),
        (at(1.5), at(2.25), Decimal("40")),
        (at(2.25), at(3), Decimal("36")),
    ]
    assert ledger_nanos(node=node) == to_nanos(
        Decimal("55.04") * Decimal("1.5") + 40 * Decimal("0.75") + 36 * Decimal("0.75")
    )


def test_spot_price_changes_mid_run_are_honoured_and_savings_kept():
    pool = cloud_pool()
    node = cloud_node(pool, capacity="spot")
    cloud_price("55.04")
    spot_price("20.00", when=at(-5), zone="us-east-1a")
    spot_price("22.50", when=at(-1), zone="us-east-1b")
    spot_price("30.00", when=at(2), zone="us-east-1a")
    allocations = Allocations([(node.pk, 9, 3, 8, at(0), None)])

    meter(allocations, until=at(4))

    rows = list(
        UsageEntry.objects.order_by("start").values_list("start", "end", "rate_per_hour", "savings")
    )
    # The dearest zone's price at each instant (the node's zone is not recorded).
    assert [(s, e, r) for s, e, r, _ in rows] == [
        (at(0), at(2), Decimal("22.5")),
        (at(2), at(4), Decimal("30")),
    ]
    assert rows[0][3] == (Decimal("55.04") - Decimal("22.5")) * 2
    assert UsageEntry.objects.filter(job_id=9).count() == 2


def test_a_spot_price_that_arrives_late_corrects_the_ledger_with_new_rows():
    pool = cloud_pool()
    node = cloud_node(pool, capacity="spot")
    cloud_price("55.04")
    spot_price("20.00", when=at(-5))
    meter(until=at(4))
    first = list(UsageEntry.objects.values_list("id", "amount"))

    # The fetch after the run brings a change that took effect at 2h: 4 × 20 becomes
    # 2 × 20 + 2 × 25, by a correction row; the first row is left as it was.
    services.spot_prices_record(
        region="us-east-1",
        quotes=[services.SpotQuote("us-east-1a", "p5.48xlarge", Decimal("25"), at(2))],
    )
    assert MeterMark.objects.get(node=node).reprice_from == at(2)
    report = meter(until=at(5))

    assert report.corrections == 1
    kept = UsageEntry.objects.filter(id__in=[i for i, _ in first]).values_list("id", "amount")
    assert list(kept) == first
    correction = UsageEntry.objects.get(corrects__isnull=False)
    assert correction.amount == Decimal(10) and correction.corrects_id == first[0][0]
    assert ledger_nanos(node=node) == to_nanos(Decimal(2 * 20 + 3 * 25))
    assert DailySpend.objects.aggregate(t=Sum("amount"))["t"] == Decimal(2 * 20 + 3 * 25)
    assert MeterMark.objects.get(node=node).reprice_from is None


def test_a_price_edited_behind_the_mark_is_corrected_not_rewritten(finance_user):
    pool = owned_pool()
    node = owned_node(pool, power_w=10000)
    price = owned_price(pool)
    meter(until=at(10))
    before = ledger_nanos(node=node)

    services.price_update(price=price, by=finance_user, purchase_price=Decimal("150000"))
    meter(until=at(10))

    assert UsageEntry.objects.filter(corrects__isnull=False).count() == 1
    cheaper = Decimal(150000) / (48 * 730) + Decimal("1.56") + 2
    assert ledger_nanos(node=node) == to_nanos(cheaper.quantize(RATE) * 10)
    assert before > ledger_nanos(node=node)


def test_owned_nodes_cost_from_registration_cloud_nodes_from_launch_to_termination():
    owned, cloud = owned_pool(), cloud_pool()
    owned_price(owned, since=at(-3))
    cloud_price("10")
    early = owned_node(owned, since=at(-2))
    launched = cloud_node(cloud, launched=at(1))
    never = cloud_node(cloud, launched=None)
    terminate(launched, at(3))
    # States in between (drained, suspect...) change nothing: a node costs while it exists.
    Node.objects.filter(pk=early.pk).update(state="drained")

    meter(until=at(6))

    assert UsageEntry.objects.filter(node=early).aggregate(s=Sum("amount"))["s"] == (
        Decimal("12.121644") * 8
    )
    assert ledger_nanos(node=launched) == to_nanos(Decimal(20))
    assert not UsageEntry.objects.filter(node=never).exists()
    assert MeterMark.objects.get(node=launched).closed
    assert not MeterMark.objects.filter(node=never).exists()


def test_rows_never_cross_a_day_in_the_costs_time_zone(settings):
    settings.COSTS_TIME_ZONE = "America/New_York"
    pool = cloud_pool()
    cloud_node(pool)
    cloud_price("1")

    meter(until=at(30))  # 00:00 UTC is 19:00 the day before in New York

    days = dict(DailySpend.objects.values_list("day").annotate(s=Sum("amount")).order_by())
    assert days == {
        dt.date(2026, 11, 1): Decimal(5),
        dt.date(2026, 11, 2): Decimal(24),
        dt.date(2026, 11, 3): Decimal(1),
    }


def test_a_metering_run_killed_half_way_and_run_again_neither_skips_nor_counts_twice(
    monkeypatch,
):
    pool = cloud_pool()
    cloud_price("3.6")  # a cent a second
    nodes = [cloud_node(pool) for _ in range(4)]
    allocations = Allocations([(n.pk, 100 + i, 1, 8, at(0), None) for i, n in enumerate(nodes)])
    meter(allocations, until=at(1), batch_size=2)

    real = ledger._rollups_add
    calls = {"n": 0}

    def dies_in_the_second_batch(sums):
        calls["n"] += 1
        real(sums)
        if calls["n"] == 2:
            raise SystemExit("worker killed")

    monkeypatch.setattr(ledger, "_rollups_add", dies_in_the_second_batch)
    with pytest.raises(SystemExit):
        meter(allocations, until=at(2), batch_size=2)
    monkeypatch.setattr(ledger, "_rollups_add", real)
    marks = dict(MeterMark.objects.values_list("node_id", "metered_until"))
    assert sorted(marks.values()) == [at(1), at(1), at(2), at(2)]  # one batch committed

    meter(allocations, until=at(3), batch_size=2)

    for node in nodes:
        rows = list(UsageEntry.objects.filter(node=node).order_by("start"))
        assert [(r.start, r.end) for r in rows] in (
            [(at(0), at(1)), (at(1), at(2)), (at(2), at(3))],
            [(at(0), at(1)), (at(1), at(3))],
        )
        assert nanos_of(rows) == to_nanos(Decimal("3.6") * 3)
    assert DailySpend.objects.aggregate(t=Sum("amount"))["t"] == Decimal("3.6") * 3 * 4


def test_a_second_run_up_to_the_same_time_adds_nothing():
    pool = owned_pool()
    owned_node(pool)
    owned_price(pool)
    meter(until=at(5))
    count = UsageEntry.objects.count()

    again = meter(until=at(5))

    assert again.rows == 0 and UsageEntry.objects.count() == count


def test_an_unpriced_node_is_metered_at_zero_until_a_price_arrives_then_corrected():
    pool = owned_pool()
    node = owned_node(pool)
    meter(until=at(4))
    assert ledger_nanos(node=node) == 0
    assert set(UsageEntry.objects.values_list("price_ref", flat=True)) == {"unpriced"}

    owned_price(pool, since=at(2))
    meter(until=at(4))

    assert ledger_nanos(node=node) == to_nanos(Decimal("12.121644") * 2)
