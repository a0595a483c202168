"""Costs: the price book, the usage ledger and its roll-ups, budgets and their alerts."""

from apps.costs.models.budgets import THRESHOLDS, Budget, BudgetAlert
from apps.costs.models.ledger import (
    DailySpend,
    JobDailySpend,
    MeterMark,
    MonthlySpend,
    UsageEntry,
    UsageKind,
)
from apps.costs.models.prices import CloudPrice, OwnedPrice, PoolDiscount, SpotPrice
