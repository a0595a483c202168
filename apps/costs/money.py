"""Money: Decimal in Python, an exact integer count of nano-units in the database.

Amounts are stored as whole nano-units (10⁻⁹ of the currency) in a bigint column, so
sums are exact on PostgreSQL and SQLite alike (SQLite would keep a decimal column as
a binary float). Python code and the API only ever see Decimal. Rounding to the cent
happens for display only, and a table's rounded parts add up to its rounded total.
"""

from collections.abc import Sequence
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from fractions import Fraction

from django import forms
from django.conf import settings
from django.core import validators
from django.db import models

NANOS = 10**9
CENT = Decimal("0.01")
NANO = Decimal("0.000000001")
ZERO = Decimal(0)


def to_nanos(value) -> int:
    """A Decimal (or int, or numeric string) amount as whole nano-units, half to even."""
    if isinstance(value, Fraction):
        return round(value * NANOS)
    amount = value if isinstance(value, Decimal) else Decimal(str(value))
    return int((amount * NANOS).to_integral_value(rounding=ROUND_HALF_EVEN))


def from_nanos(nanos) -> Decimal:
    return Decimal(int(nanos)).scaleb(-9)


def nanos_text(nanos: int) -> str:
    """The amount as plain text with nine decimals (fast: no Decimal per CSV row)."""
    sign = "-" if nanos < 0 else ""
    whole, part = divmod(abs(nanos), NANOS)
    return f"{sign}{whole}.{part:09d}"


def cents(value: Decimal) -> Decimal:
    """Rounded to the cent, for display (half up, as invoices do)."""
    return (value or ZERO).quantize(CENT, rounding=ROUND_HALF_UP)


def apportion_cents(values: Sequence[Decimal]) -> list[Decimal]:
    """Round each part to the cent so that the parts add up to the rounded total.

    Largest remainder: every part is rounded down, and the cents still missing go to
    the parts that lost most, so a table's column adds up to its total row.
    """
    if not values:
        return []
    total = cents(sum(values, ZERO))
    floors = [v.quantize(CENT, rounding="ROUND_FLOOR") for v in values]
    missing = int((total - sum(floors, ZERO)) / CENT)
    order = sorted(range(len(values)), key=lambda i: (values[i] - floors[i], -i), reverse=True)
    for i in order[: max(missing, 0)]:
        floors[i] += CENT
    return floors


def money_text(value: Decimal | None, *, places: int = 2) -> str:
    """`$1,234.56` (the currency symbol for USD, the code otherwise)."""
    if value is None:
        return "—"
    currency = settings.COSTS_CURRENCY
    quantum = Decimal(1).scaleb(-places)
    shown = (value or ZERO).quantize(quantum, rounding=ROUND_HALF_UP)
    text = f"{abs(shown):,.{places}f}"
    sign = "−" if shown < 0 else ""
    return f"{sign}${text}" if currency == "USD" else f"{sign}{text} {currency}"


class MoneyField(models.BigIntegerField):
    """An amount held as a Decimal, stored as exact nano-units (see the module's docstring)."""

    description = "An amount of money, exact to 10⁻⁹"

    def from_db_value(self, value, expression, connection):
        return None if value is None else from_nanos(value)

    def to_python(self, value):
        if value is None or isinstance(value, Decimal):
            return value
        try:
            return Decimal(str(value))
        except ArithmeticError:
            raise validators.ValidationError("Enter an amount.", code="invalid") from None

    def get_prep_value(self, value):
        if value is None:
            return None
        return to_nanos(value)

    def formfield(self, **kwargs):
        return forms.DecimalField(max_digits=20, decimal_places=9, **kwargs)
