"""Template filters for money: `{{ amount|money }}` is `$1,234.57` (rounded for display only);
and how often spend is metered, for the pages that show it."""

from decimal import Decimal

from django import template
from django.conf import settings
from django.template.defaultfilters import pluralize

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


@register.simple_tag
def metered_every() -> str:
    """How often spend is metered into the ledger: `every 5 minutes`."""
    seconds = settings.COSTS_METER_EVERY_S
    if seconds % 60:
        return f"every {seconds} second{pluralize(seconds)}"
    minutes = seconds // 60
    return f"every {minutes} minute{pluralize(minutes)}" if minutes != 1 else "every minute"
