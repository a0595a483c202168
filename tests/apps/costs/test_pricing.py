"""What a cloud burst is projected to cost before it is asked for (pricing.burst_cost):
never below the exact cost, at most a nano-unit above it, monotone in what it asks for,
and never above the job's own cost limit."""

from decimal import Decimal
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from apps.costs.pricing import burst_cost

NANO = Decimal("0.000000001")

# Rates as the price book holds them: per node-hour, to 10⁻⁶.
rates = st.integers(min_value=0, max_value=500 * 10**6).map(lambda n: Decimal(n).scaleb(-6))
gpus = st.integers(min_value=1, max_value=512)
node_gpus = st.sampled_from([1, 2, 3, 4, 7, 8, 16])
limits = st.integers(min_value=1, max_value=30 * 86400)
max_costs = st.integers(min_value=0, max_value=10**8).map(lambda n: Decimal(n).scaleb(-2))


def exact(rate: Decimal, gpus: int, limit_s: int, node_gpus: int) -> Fraction:
    return Fraction(rate) * gpus * limit_s / (node_gpus * 3600)


@given(rates, gpus, limits, node_gpus)
def test_the_projection_is_the_exact_cost_rounded_up_to_a_nano_unit(rate, n, limit, per_node):
    cost = burst_cost(gpus=n, time_limit_s=limit, per_node_hour=rate, node_gpus=per_node)
    assert isinstance(cost, Decimal)
    assert cost == cost.quantize(NANO)  # whole nano-units: exact from here on
    assert Fraction(cost) >= exact(rate, n, limit, per_node)
    assert Fraction(cost) - exact(rate, n, limit, per_node) < Fraction(NANO)


@given(rates, gpus, limits, node_gpus, st.integers(1, 64), st.integers(1, 86400))
def test_more_gpus_or_a_longer_limit_never_cost_less(rate, n, limit, per_node, more, longer):
    def cost(g, t):
        return burst_cost(gpus=g, time_limit_s=t, per_node_hour=rate, node_gpus=per_node)

    assert cost(n + more, limit) >= cost(n, limit)
    assert cost(n, limit + longer) >= cost(n, limit)


@given(rates, gpus, limits, node_gpus, max_costs)
def test_the_job_cost_limit_caps_the_projection(rate, n, limit, per_node, max_cost):
    uncapped = burst_cost(gpus=n, time_limit_s=limit, per_node_hour=rate, node_gpus=per_node)
    capped = burst_cost(
        gpus=n, time_limit_s=limit, per_node_hour=rate, node_gpus=per_node, max_cost=max_cost
    )
    assert capped <= max_cost
    assert capped == min(uncapped, max_cost)


def test_known_figures():
    # A p5.48xlarge (8 GPUs) at its list price, all of it for an hour; half of it for 90 min.
    assert burst_cost(gpus=8, time_limit_s=3600, per_node_hour=Decimal("55.04"), node_gpus=8) == (
        Decimal("55.04")
    )
    assert burst_cost(
        gpus=4, time_limit_s=5400, per_node_hour=Decimal("55.04"), node_gpus=8
    ) == Decimal("41.28")
    # A third of a dollar is no finite decimal: rounded up, never down.
    assert burst_cost(gpus=1, time_limit_s=3600, per_node_hour=Decimal(1), node_gpus=3) == Decimal(
        "0.333333334"
    )


def test_without_a_price_only_the_job_cost_limit_bounds_it():
    assert burst_cost(gpus=8, time_limit_s=3600, per_node_hour=None, node_gpus=8) is None
    assert burst_cost(
        gpus=8, time_limit_s=3600, per_node_hour=None, node_gpus=8, max_cost=Decimal("12.50")
    ) == Decimal("12.50")
