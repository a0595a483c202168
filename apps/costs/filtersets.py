"""One FilterSet per costs model: the Costs page, the API's query parameters and the CSV
exports filter alike (`?since=2026-11-01&until=2026-11-30&team_id=3&capacity_type=spot`)."""

import django_filters as filters

from apps.costs.models import (
    Budget,
    BudgetAlert,
    CloudPrice,
    DailySpend,
    JobDailySpend,
    MonthlySpend,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
    UsageEntry,
    UsageKind,
)
from apps.costs.models.budgets import WEBHOOK_STATES
from apps.fleet.models.nodes import CapacityType
from controlplane.filters import IdFilter, InstantFilter


class _Days(filters.FilterSet):
    """A range of days (in COSTS_TIME_ZONE), both ends included."""

    since = filters.DateFilter(field_name="day", lookup_expr="gte", label="From (day)")
    until = filters.DateFilter(field_name="day", lookup_expr="lte", label="To (day, included)")


class _SpendGroups(filters.FilterSet):
    """What the roll-ups are kept by, besides the day or month."""

    team_id = IdFilter(field_name="team_id")
    pool_id = IdFilter(field_name="pool_id")
    instance_type_id = IdFilter(field_name="instance_type_id")
    capacity_type = filters.ChoiceFilter(choices=CapacityType.choices)


class DailySpendFilterSet(_Days, _SpendGroups):
    class Meta:
        model = DailySpend
        fields = []


class MonthlySpendFilterSet(_SpendGroups):
    """The filters of DailySpendFilterSet but the days (whole months are picked by the report)."""

    class Meta:
        model = MonthlySpend
        fields = []


class JobDailySpendFilterSet(_Days):
    team_id = IdFilter(field_name="team_id")
    job_id = IdFilter(field_name="job_id")

    class Meta:
        model = JobDailySpend
        fields = []


class UsageEntryFilterSet(_Days):
    team_id = IdFilter(field_name="team_id")
    job_id = IdFilter(field_name="job_id")
    node_id = IdFilter(field_name="node_id")
    pool_id = IdFilter(field_name="pool_id")
    instance_type_id = IdFilter(field_name="instance_type_id")
    capacity_type = filters.ChoiceFilter(choices=CapacityType.choices)
    kind = filters.ChoiceFilter(choices=UsageKind.choices)
    corrections = filters.BooleanFilter(
        field_name="corrects", lookup_expr="isnull", exclude=True, label="Corrections only"
    )

    class Meta:
        model = UsageEntry
        fields = []


class OwnedPriceFilterSet(filters.FilterSet):
    pool_id = IdFilter(field_name="pool_id")

    class Meta:
        model = OwnedPrice
        fields = []


class CloudPriceFilterSet(filters.FilterSet):
    instance_type_id = IdFilter(field_name="instance_type_id")

    class Meta:
        model = CloudPrice
        fields = ["region"]


class PoolDiscountFilterSet(filters.FilterSet):
    pool_id = IdFilter(field_name="pool_id")

    class Meta:
        model = PoolDiscount
        fields = []


class SpotPriceFilterSet(filters.FilterSet):
    instance_type_id = IdFilter(field_name="instance_type_id")
    since = InstantFilter(field_name="effective_at", lookup_expr="gte")

    class Meta:
        model = SpotPrice
        fields = ["region", "availability_zone"]


class BudgetFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")

    class Meta:
        model = Budget
        fields = ["stop_submissions"]


class BudgetAlertFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")
    webhook_state = filters.ChoiceFilter(choices=WEBHOOK_STATES, method="filter_webhook_state")

    class Meta:
        model = BudgetAlert
        fields = ["month", "threshold"]

    def filter_webhook_state(self, queryset, name, value):
        if value == "none":
            return queryset.filter(webhook_call__isnull=True)
        return queryset.filter(webhook_call__state=value)
