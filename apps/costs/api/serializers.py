"""JSON shapes of the price book, the ledger, spend reports, budgets and their alerts.

Money is a decimal string (exact; rounded to the cent only on pages), in COSTS_CURRENCY.
"""

from decimal import Decimal

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.accounts.selectors import teams_visible_to
from apps.costs import pricing, selectors
from apps.costs.models import (
    Budget,
    BudgetAlert,
    CloudPrice,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
    UsageEntry,
)
from apps.costs.models.budgets import WEBHOOK_STATES
from apps.costs.reports import GROUP_CHOICES, IDLE_CHOICES
from apps.costs.services import ENTRY_FIELDS
from controlplane.api import ScopedPrimaryKeyField, StrictModelSerializer, StrictSerializer, Text


def Money(**kwargs):
    return serializers.DecimalField(max_digits=24, decimal_places=9, **kwargs)


class OwnedPriceSerializer(StrictModelSerializer):
    rate = serializers.SerializerMethodField(
        help_text="Per node-hour for a typical node of the pool: amortised + power + overhead."
    )

    class Meta:
        model = OwnedPrice
        fields = [
            "id",
            "pool",
            "effective_from",
            "purchase_price",
            "depreciation_months",
            "electricity_per_kwh",
            "pue",
            "overhead_per_month",
            "default_power_w",
            "source",
            "rate",
            "created_at",
        ]
        read_only_fields = ["created_at"]
        validators = []  # the service's full_clean names the field on a duplicate

    @extend_schema_field(
        {
            "type": "object",
            "properties": {
                k: {"type": "string"}
                for k in ("amortised", "power", "overhead", "per_node_hour", "per_gpu_hour")
            },
        }
    )
    def get_rate(self, price) -> dict:
        views = self.context.setdefault(
            "_owned_views", {v.price.pk: v for v in selectors.owned_prices()}
        )
        view = views.get(price.pk)
        if view is None:
            return {}
        return {
            "amortised": str(view.rate.amortised),
            "power": str(view.rate.power),
            "overhead": str(view.rate.overhead),
            "per_node_hour": str(view.rate.per_hour),
            "per_gpu_hour": str(view.per_gpu_hour.quantize(pricing.RATE_QUANTUM)),
            "power_w": view.rate.power_w,
        }


class CloudPriceSerializer(StrictModelSerializer):
    instance_type_name = serializers.CharField(source="instance_type.name", read_only=True)

    class Meta:
        model = CloudPrice
        fields = [
            "id",
            "instance_type",
            "instance_type_name",
            "region",
            "effective_from",
            "per_hour",
            "source",
            "created_at",
        ]
        read_only_fields = ["created_at"]
        validators = []


class PoolDiscountSerializer(StrictModelSerializer):
    class Meta:
        model = PoolDiscount
        fields = ["id", "pool", "effective_from", "percent", "source", "created_at"]
        read_only_fields = ["created_at"]
        validators = []


class SpotPriceSerializer(StrictModelSerializer):
    instance_type_name = serializers.CharField(source="instance_type.name", read_only=True)

    class Meta:
        model = SpotPrice
        fields = [
            "id",
            "instance_type",
            "instance_type_name",
            "region",
            "availability_zone",
            "effective_at",
            "per_hour",
            "fetched_at",
        ]
        read_only_fields = fields


class UsageEntrySerializer(StrictModelSerializer):
    rate_per_hour = Money(read_only=True)
    amount = Money(read_only=True)
    savings = Money(read_only=True)

    class Meta:
        model = UsageEntry
        fields = ["id", *ENTRY_FIELDS]
        read_only_fields = fields


class CorrectionSerializer(StrictSerializer):
    amount = serializers.DecimalField(
        max_digits=18, decimal_places=9, help_text="Added to the row (negative takes away)."
    )
    note = Text(max_length=200, help_text="Why.")


class SpendQuerySerializer(StrictSerializer):
    """The query parameters the report takes besides the FilterSet's."""

    group_by = serializers.ChoiceField(choices=GROUP_CHOICES, required=False)
    idle = serializers.ChoiceField(choices=IDLE_CHOICES, required=False)


class SpendRowSerializer(StrictSerializer):
    key = serializers.CharField(allow_null=True)
    label = serializers.CharField()
    jobs = Money()
    idle = Money()
    total = Money()
    gpu_hours = serializers.DecimalField(max_digits=20, decimal_places=3)
    savings = Money()


class SpendSerializer(StrictSerializer):
    since = serializers.DateField()
    until = serializers.DateField()
    group_by = serializers.CharField()
    idle_mode = serializers.CharField()
    currency = serializers.CharField()
    total = Money()
    jobs = Money()
    idle = Money()
    savings = Money(help_text="Spot's savings against the on-demand rate.")
    forecast_month_end = Money(help_text="This month's spend by its end, from recent days.")
    rows = SpendRowSerializer(many=True)


class DailySpendSerializer(StrictSerializer):
    day = serializers.DateField()
    group = serializers.CharField()
    amount = Money()


class TopJobSerializer(StrictSerializer):
    job = serializers.IntegerField()
    name = serializers.CharField()
    team = serializers.CharField()
    amount = Money()
    gpu_hours = serializers.DecimalField(max_digits=20, decimal_places=3)


class BudgetSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to)
    monthly_limit = serializers.DecimalField(max_digits=14, decimal_places=2, min_value=0)
    state = serializers.SerializerMethodField()

    class Meta:
        model = Budget
        fields = [
            "id",
            "team",
            "monthly_limit",
            "stop_submissions",
            "notify_emails",
            "webhook_url",
            "state",
            "updated_at",
        ]
        read_only_fields = ["updated_at"]
        validators = []

    @extend_schema_field(
        {
            "type": "object",
            "properties": {
                "month": {"type": "string", "format": "date"},
                "spent": {"type": "string"},
                "percent": {"type": "string"},
                "forecast": {"type": "string", "nullable": True},
                "level": {"type": "integer"},
                "bursting_stopped": {"type": "boolean"},
            },
        }
    )
    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["webhook_url"] = selectors.budget_webhook_url_seen_by(
            budget=instance, user=self.context["request"].user
        )
        return data

    def get_state(self, budget) -> dict:
        if "_budget_states" not in self.context:
            self.context["_budget_states"] = {s.team_id: s for s in selectors.budget_states()}
        states = self.context["_budget_states"]
        state = states.get(budget.team_id)
        if state is None:
            return {}
        return {
            "month": state.month,
            "spent": str(state.spent),
            "percent": str(state.percent.quantize(Decimal("0.1"))),
            "forecast": None if state.forecast is None else str(state.forecast),
            "level": state.level,
            "bursting_stopped": state.exhausted,
        }


class BudgetCreatedSerializer(BudgetSerializer):
    webhook_signing_key = serializers.CharField(
        read_only=True,
        allow_null=True,
        help_text="Shown once, when the webhook URL is new: X-Controlplane-Signature is the "
        "sha256 HMAC of the body under it.",
    )

    class Meta(BudgetSerializer.Meta):
        fields = [*BudgetSerializer.Meta.fields, "webhook_signing_key"]


class BudgetAlertSerializer(StrictModelSerializer):
    team_slug = serializers.CharField(source="team.slug", read_only=True)
    spent = Money(read_only=True)
    webhook_state = serializers.ChoiceField(
        choices=WEBHOOK_STATES, read_only=True, help_text="The call to the budget's webhook."
    )
    webhook_attempts = serializers.IntegerField(read_only=True)

    class Meta:
        model = BudgetAlert
        fields = [
            "id",
            "team",
            "team_slug",
            "month",
            "threshold",
            "spent",
            "monthly_limit",
            "at",
            "emailed_to",
            "webhook_state",
            "webhook_attempts",
        ]
        read_only_fields = fields
