"""Filters for account lists; the same sets serve API query parameters and pages."""

import django_filters as filters

from apps.accounts.models import (
    ApiToken,
    AuditEvent,
    Membership,
    ServiceAccount,
    Team,
    TeamQuota,
    TeamSecret,
)
from controlplane.filters import IdFilter, InstantFilter


class TeamFilterSet(filters.FilterSet):
    q = filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")

    class Meta:
        model = Team
        fields = ["slug"]


class TeamQuotaFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")

    class Meta:
        model = TeamQuota
        fields = ["gpu_type"]


class MembershipFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")
    username = filters.CharFilter(field_name="user__username")

    class Meta:
        model = Membership
        fields = ["role"]


class ServiceAccountFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")

    class Meta:
        model = ServiceAccount
        fields = ["name"]


class ApiTokenFilterSet(filters.FilterSet):
    revoked = filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = ApiToken
        fields = ["name"]


class AuditEventFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")
    since = InstantFilter(field_name="at", lookup_expr="gte")
    until = InstantFilter(field_name="at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = ["action", "object_type", "object_id", "actor_label", "channel"]


class TeamSecretFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")

    class Meta:
        model = TeamSecret
        fields = ["name"]
