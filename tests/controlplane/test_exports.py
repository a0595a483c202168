"""CSV cells: free text never starts a formula; numbers stay numbers, in every export."""

import csv
import io
from decimal import Decimal

import pytest
from django.test import Client
from hypothesis import example, given
from hypothesis import strategies as st

from apps.fleet.models import InstanceType
from controlplane.exports import FORMULA_STARTS, PLAIN_NUMBER, csv_response, spreadsheet_safe

FORMULAS = st.sampled_from(FORMULA_STARTS).flatmap(lambda start: st.text().map(start.__add__))


@given(st.one_of(st.text(), FORMULAS))
@example("-2+3+cmd|' /C calc'!A0")
@example("-3.5")
def test_no_text_cell_starts_a_formula(text):
    cell = spreadsheet_safe(text)
    assert not cell.startswith(FORMULA_STARTS) or PLAIN_NUMBER.fullmatch(cell)
    assert cell.removeprefix("'") == text or cell == text  # only a quote is added


@given(st.one_of(st.integers(), st.decimals(allow_nan=False, allow_infinity=False), st.floats()))
def test_numbers_written_as_text_stay_numbers(number):
    text = f"{number:f}" if isinstance(number, Decimal) else str(number)
    if text.lstrip("+-")[:1].isdigit():  # not inf or nan
        assert spreadsheet_safe(text) == text


@pytest.mark.django_db
def test_the_price_book_csv_neutralises_every_text_cell(finance_user):
    """Instance types, regions and zones come from AWS or ops, and reached the CSV as they were."""
    import datetime as dt

    from apps.costs.models import CloudPrice, SpotPrice
    from tests.apps.costs.conftest import cloud_price, spot_price

    cloud_price("55.04")
    spot_price("20.00", when=dt.datetime(2026, 11, 1, tzinfo=dt.UTC))
    # Stored as a catalogue sync or an admin could store them, past the forms' checks.
    CloudPrice.objects.update(region='=HYPERLINK("http://a.b","x")')
    SpotPrice.objects.update(availability_zone="@SUM(A1)")
    InstanceType.objects.filter(name="p5.48xlarge").update(name="+cmd|' /C calc'!A0")
    client = Client()
    client.force_login(finance_user)
    response = client.get("/costs/prices.csv")
    body = b"".join(response.streaming_content).decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    cloud = next(r for r in rows if r["kind"] == "on_demand")
    spot = next(r for r in rows if r["kind"] == "spot")
    assert cloud["region_or_zone"] == """'=HYPERLINK("http://a.b","x")"""
    assert cloud["instance_type"] == spot["instance_type"] == "'+cmd|' /C calc'!A0"
    assert spot["region_or_zone"] == "'@SUM(A1)"
    assert cloud["per_node_hour"] == "55.040000"
    for row in rows:
        for cell in row.values():
            assert not cell.startswith(FORMULA_STARTS) or PLAIN_NUMBER.fullmatch(cell)


@given(st.one_of(st.integers(), st.decimals(allow_nan=False, allow_infinity=False), st.floats()))
def test_numbers_are_written_as_numbers_their_sign_included(number):
    assert spreadsheet_safe(number) == str(number)


def test_a_negative_amount_reads_back_as_a_number():
    response = csv_response("t.csv", ["what", "amount"], [["=1+1", Decimal("-12.50")]])
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[1] == ["'=1+1", "-12.50"]
