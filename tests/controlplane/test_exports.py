"""CSV cells: free text never starts a formula; numbers stay numbers."""

import csv
import io
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from controlplane.exports import FORMULA_STARTS, csv_response, spreadsheet_safe


@given(st.text())
def test_no_text_cell_starts_a_formula(text):
    cell = spreadsheet_safe(text)
    assert not cell.startswith(FORMULA_STARTS)
    assert cell.removeprefix("'") == text or cell == text  # only a quote is added


@given(st.one_of(st.integers(), st.decimals(allow_nan=False, allow_infinity=False), st.floats()))
def test_numbers_are_written_as_numbers_their_sign_included(number):
    assert spreadsheet_safe(number) == str(number)


def test_a_negative_amount_reads_back_as_a_number():
    response = csv_response("t.csv", ["what", "amount"], [["=1+1", Decimal("-12.50")]])
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[1] == ["'=1+1", "-12.50"]
