"""Money's display rounding: a table's rounded parts add up to its rounded total."""

from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from apps.costs.money import CENT, apportion_cents, cents, from_nanos, nanos_text, to_nanos

# Amounts as the ledger holds them: whole nano-units, corrections below zero included.
amounts = st.integers(min_value=-(10**15), max_value=10**15).map(from_nanos)


@given(st.lists(amounts, max_size=30))
def test_the_rounded_parts_add_up_to_the_rounded_total_each_within_a_cent(values):
    parts = apportion_cents(values)
    assert len(parts) == len(values)
    if values:
        assert sum(parts, Decimal(0)) == cents(sum(values, Decimal(0)))
    for part, value in zip(parts, values, strict=True):
        assert part % CENT == 0
        assert abs(part - value) < CENT


def test_a_column_of_thirds_adds_up():
    third = Decimal(1) / 3
    assert apportion_cents([third, third, third]) == [
        Decimal("0.34"),
        Decimal("0.33"),
        Decimal("0.33"),
    ]


@given(st.integers(min_value=-(10**17), max_value=10**17))
def test_nanos_round_trip_through_decimal_and_text(nanos):
    assert to_nanos(from_nanos(nanos)) == nanos
    assert Decimal(nanos_text(nanos)) == from_nanos(nanos)
