"""Template filters for money: `{{ amount|money }}` is `$1,234.57` (rounded for display only)."""

from decimal import Decimal

from django import template

from apps.costs.money import money_text

register = template.Library()


@register.filter
def money(value, places: int = 2) -> str:
    if value in (None, ""):
        return "—"
    return money_text(Decimal(value), places=int(places))


@register.filter
def percent(value) -> str:
    if value in (None, ""):
        return "—"
    return f"{Decimal(value):.0f}%"
