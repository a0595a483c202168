"""Give `make run`'s demo fleet a price book: an owned price for every owned pool that has
none, so the Costs page has figures to show. Demo figures, labelled as such; safe to run
again (it adds only what is missing)."""

import datetime as dt
from decimal import Decimal

from django.core.management.base import BaseCommand

from apps.accounts.context import Origin, acting_from
from apps.costs import services
from apps.costs.models import OwnedPrice
from apps.fleet.models import PoolKind
from apps.fleet.selectors import pools_of_kind

DEMO_TERMS = {
    "purchase_price": Decimal("300000.00"),  # an 8-GPU H100 server, roughly
    "depreciation_months": 48,
    "electricity_per_kwh": Decimal("0.12000"),
    "pue": Decimal("1.30"),
    "overhead_per_month": Decimal("1500.00"),
    "default_power_w": 10200,
    "source": "Demo figures for make run, not a quote: replace them with your own.",
}


class Command(BaseCommand):
    help = "Add demo owned prices for owned pools without one (idempotent)."

    def handle(self, *args, **options):
        priced = set(OwnedPrice.objects.values_list("pool_id", flat=True))
        added = 0
        with acting_from(Origin(channel="cli", label="demo_prices")):
            for pool in pools_of_kind(PoolKind.OWNED).exclude(pk__in=priced):
                services.owned_price_create(
                    by=None,
                    pool=pool,
                    effective_from=pool.created_at - dt.timedelta(days=1),
                    **DEMO_TERMS,
                )
                added += 1
        self.stdout.write(f"demo prices: {added} owned price(s) added")
