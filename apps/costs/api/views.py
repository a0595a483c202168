"""API views for costs: the price book (finance writes), the ledger, spend reports, budgets."""

from decimal import Decimal

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.costs import reports, selectors, services
from apps.costs.api import serializers as s
from apps.costs.filtersets import (
    BudgetAlertFilterSet,
    BudgetFilterSet,
    CloudPriceFilterSet,
    OwnedPriceFilterSet,
    PoolDiscountFilterSet,
    SpotPriceFilterSet,
    UsageEntryFilterSet,
)
from apps.costs.models import SpotPrice
from apps.costs.money import NANO
from controlplane.api import ServiceViewSet
from controlplane.errors import ApplicationError

REPORT_PARAMETERS = [
    OpenApiParameter("since", str, description="First day (YYYY-MM-DD); default: the 1st."),
    OpenApiParameter("until", str, description="Last day, included; default: today."),
    OpenApiParameter("team_id", int),
    OpenApiParameter("pool_id", int),
    OpenApiParameter("capacity_type", str, enum=["owned", "on_demand", "spot"]),
    OpenApiParameter("instance_type_id", int),
]


class OwnedPriceViewSet(ServiceViewSet):
    """What owned pools' nodes cost: everyone reads; finance writes."""

    serializer_class = s.OwnedPriceSerializer
    filterset_class = OwnedPriceFilterSet
    ordering_fields = ["effective_from", "id"]
    create_service = services.owned_price_create
    update_service = services.price_update
    delete_service = services.price_delete
    instance_kwarg = "price"

    def get_queryset(self):
        return selectors.owned_price_rows()


class CloudPriceViewSet(ServiceViewSet):
    """On-demand list prices per instance type and region: everyone reads; finance writes."""

    serializer_class = s.CloudPriceSerializer
    filterset_class = CloudPriceFilterSet
    ordering_fields = ["effective_from", "id"]
    create_service = services.cloud_price_create
    update_service = services.price_update
    delete_service = services.price_delete
    instance_kwarg = "price"

    def get_queryset(self):
        return selectors.cloud_prices()


class PoolDiscountViewSet(ServiceViewSet):
    """Negotiated discounts on cloud pools' on-demand list prices: finance writes."""

    serializer_class = s.PoolDiscountSerializer
    filterset_class = PoolDiscountFilterSet
    ordering_fields = ["effective_from", "id"]
    create_service = services.pool_discount_create
    update_service = services.price_update
    delete_service = services.price_delete
    instance_kwarg = "price"

    def get_queryset(self):
        return selectors.pool_discounts()


class SpotPriceViewSet(viewsets.ReadOnlyModelViewSet):
    """Spot prices as EC2 reported them, each in force from `effective_at` in its zone."""

    serializer_class = s.SpotPriceSerializer
    filterset_class = SpotPriceFilterSet
    ordering_fields = ["effective_at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return SpotPrice.objects.select_related("instance_type").order_by("-effective_at", "id")


class UsageEntryViewSet(viewsets.ReadOnlyModelViewSet):
    """The usage ledger (append-only): your teams' rows; ops and finance read every row,
    idle included. Finance corrects a row with a new one."""

    serializer_class = s.UsageEntrySerializer
    filterset_class = UsageEntryFilterSet
    ordering_fields = ["day", "start", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return selectors.usage_visible_to(user=self.request.user).order_by("day", "id")

    @extend_schema(request=s.CorrectionSerializer, responses={201: s.UsageEntrySerializer})
    @action(detail=True, methods=["post"])
    def correct(self, request, pk=None):
        """Add a correction row to this one (finance): the row itself is never edited."""
        body = s.CorrectionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        row = services.usage_correct(
            entry=self.get_object(), by=request.user, **body.validated_data
        )
        return Response(s.UsageEntrySerializer(row).data, status=status.HTTP_201_CREATED)


class SpendView(APIView):
    """Spend over a range of days grouped by team, pool, capacity type or instance type, with
    idle cost as its own line or spread over teams; the same filters as the Costs page."""

    @extend_schema(
        parameters=[*REPORT_PARAMETERS, s.SpendQuerySerializer], responses=s.SpendSerializer
    )
    def get(self, request):
        report = reports.build(
            user=request.user, query=request.query_params, series=False, jobs=False, budgets=False
        )
        spend = report.spend
        # Formatted here rather than through SpendSerializer (which documents the shape):
        # a month of a thousand teams is five thousand decimals, slow through DRF's fields.
        return Response(
            {
                "since": spend.since,
                "until": spend.until,
                "group_by": spend.group_by,
                "idle_mode": spend.idle_mode,
                "currency": settings.COSTS_CURRENCY,
                "total": _money(spend.total),
                "jobs": _money(spend.jobs),
                "idle": _money(spend.idle),
                "savings": _money(spend.savings),
                "forecast_month_end": _money(report.forecast_total),
                "rows": [
                    {
                        "key": None if row.key is None else str(row.key),
                        "label": row.label,
                        "jobs": _money(row.jobs),
                        "idle": _money(row.idle),
                        "total": _money(row.total),
                        "gpu_hours": f"{row.gpu_hours:.3f}",
                        "savings": _money(row.savings),
                    }
                    for row in spend.rows
                ],
            }
        )


def _money(value) -> str:
    return f"{Decimal(value).quantize(NANO):f}"


class DailySpendView(APIView):
    """Spend per day and group: the Costs page's chart, as data (the six largest groups,
    and the rest as "other")."""

    @extend_schema(
        parameters=[*REPORT_PARAMETERS, s.SpendQuerySerializer],
        responses=s.DailySpendSerializer(many=True),
    )
    def get(self, request):
        report = reports.build(
            user=request.user, query=request.query_params, jobs=False, budgets=False, forecast=False
        )
        rows = [
            {"day": day, "group": label, "amount": amounts[day]}
            for label, amounts in sorted(report.spend.series.items())
            for day in sorted(amounts)
        ]
        return Response(s.DailySpendSerializer(rows, many=True).data)


class TopJobsView(APIView):
    """The jobs that cost most over the range (your teams' jobs)."""

    @extend_schema(
        parameters=[*REPORT_PARAMETERS, OpenApiParameter("top", int, description="How many.")],
        responses=s.TopJobSerializer(many=True),
    )
    def get(self, request):
        report = reports.build(
            user=request.user,
            query=request.query_params,
            series=False,
            budgets=False,
            forecast=False,
        )
        rows = [
            {
                "job": job.job_id,
                "name": job.name,
                "team": job.team,
                "amount": job.amount,
                "gpu_hours": job.gpu_hours,
            }
            for job in report.top_jobs
        ]
        return Response(s.TopJobSerializer(rows, many=True).data)


class BudgetViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Monthly budgets per team, with this month's spend, forecast and level. Finance sets any
    team's; a team's admins set their own. POST sets (creates or replaces) a team's budget."""

    serializer_class = s.BudgetSerializer
    filterset_class = BudgetFilterSet
    lookup_value_regex = ServiceViewSet.lookup_value_regex
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self):
        return selectors.budgets_visible_to(user=self.request.user).order_by("team__slug")

    def _set(self, request, *, instance=None, partial=False):
        body = s.BudgetSerializer(
            instance, data=request.data, partial=partial, context=self.get_serializer_context()
        )
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        team = data.pop("team", None)
        if instance is not None:
            if team is not None and team != instance.team:
                raise ApplicationError(
                    "A budget stays with its team.", details={"team": ["Cannot be changed."]}
                )
            team = instance.team
        if instance is not None:
            for name in ("monthly_limit", "stop_submissions", "notify_emails", "webhook_url"):
                data.setdefault(name, getattr(instance, name))
        budget, key = services.budget_set(team=team, by=request.user, **data)
        budget.webhook_signing_key = key
        answer = s.BudgetCreatedSerializer(budget, context=self.get_serializer_context()).data
        return Response(answer, status=status.HTTP_200_OK if instance else status.HTTP_201_CREATED)

    @extend_schema(request=s.BudgetSerializer, responses={201: s.BudgetCreatedSerializer})
    def create(self, request, *args, **kwargs):
        return self._set(request)

    @extend_schema(request=s.BudgetSerializer, responses=s.BudgetCreatedSerializer)
    def partial_update(self, request, *args, **kwargs):
        return self._set(request, instance=self.get_object(), partial=True)

    def perform_destroy(self, instance):
        services.budget_delete(budget=instance, by=self.request.user)


class BudgetAlertViewSet(viewsets.ReadOnlyModelViewSet):
    """The 50, 80 and 100% thresholds teams crossed, one row each per month."""

    serializer_class = s.BudgetAlertSerializer
    filterset_class = BudgetAlertFilterSet
    ordering_fields = ["at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return selectors.budget_alerts_visible_to(user=self.request.user).order_by("-at", "-id")
