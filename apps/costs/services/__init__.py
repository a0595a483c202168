"""Writes for costs, by concern: the price book, metering into the ledger, budgets and alerts."""

from apps.costs.services.budgets import (
    budget_delete,
    budget_set,
    budgets_check,
)
from apps.costs.services.ledger import (
    ENTRY_FIELDS,
    Held,
    rollups_rebuild,
    usage_correct,
    usage_meter,
)
from apps.costs.services.prices import (
    SpotQuote,
    cloud_price_create,
    owned_price_create,
    pool_discount_create,
    price_create,
    price_delete,
    price_update,
    spot_prices_record,
)
