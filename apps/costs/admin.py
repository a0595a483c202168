"""Admin for costs: the price book through the services (finance only); the ledger, roll-ups,
marks, budgets and alerts read-only here (budgets are set on the Costs page or the API)."""

from django.contrib import admin

from apps.accounts.admin import AuditedAdmin, ReadOnlyAdmin
from apps.costs import services
from apps.costs.models import (
    Budget,
    BudgetAlert,
    CloudPrice,
    DailySpend,
    MeterMark,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
    UsageEntry,
)


class PriceAdmin(AuditedAdmin):
    update_service = services.price_update
    delete_service = services.price_delete
    instance_kwarg = "price"
    exclude = ["created_by"]


@admin.register(OwnedPrice)
class OwnedPriceAdmin(PriceAdmin):
    create_service = services.owned_price_create
    list_display = [
        "pool",
        "effective_from",
        "purchase_price",
        "depreciation_months",
        "electricity_per_kwh",
        "pue",
        "overhead_per_month",
    ]
    list_filter = ["pool"]


@admin.register(CloudPrice)
class CloudPriceAdmin(PriceAdmin):
    create_service = services.cloud_price_create
    list_display = ["instance_type", "region", "effective_from", "per_hour", "source"]
    list_filter = ["region", "instance_type"]


@admin.register(PoolDiscount)
class PoolDiscountAdmin(PriceAdmin):
    create_service = services.pool_discount_create
    list_display = ["pool", "effective_from", "percent", "source"]


@admin.register(SpotPrice)
class SpotPriceAdmin(ReadOnlyAdmin):
    list_display = ["instance_type", "availability_zone", "effective_at", "per_hour"]
    list_filter = ["region", "instance_type"]


@admin.register(UsageEntry)
class UsageEntryAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "day",
        "node_id",
        "team_id",
        "job_id",
        "kind",
        "capacity_type",
        "gpus",
        "start",
        "end",
        "amount",
        "corrects_id",
    ]
    list_filter = ["kind", "capacity_type"]
    show_full_result_count = False  # tens of millions of rows: no COUNT(*) per page


@admin.register(DailySpend)
class DailySpendAdmin(ReadOnlyAdmin):
    list_display = ["day", "team_id", "pool_id", "capacity_type", "instance_type_id", "amount"]
    date_hierarchy = "day"


@admin.register(MeterMark)
class MeterMarkAdmin(ReadOnlyAdmin):
    list_display = ["node_id", "metered_until", "closed", "reprice_from"]


@admin.register(Budget)
class BudgetAdmin(ReadOnlyAdmin):
    list_display = ["team", "monthly_limit", "stop_submissions", "webhook_url", "updated_at"]
    exclude = ["webhook_signing_key"]


@admin.register(BudgetAlert)
class BudgetAlertAdmin(ReadOnlyAdmin):
    list_display = ["team", "month", "threshold", "spent", "at", "emailed_to", "webhook_state"]
    list_filter = ["threshold", "webhook_call__state"]
