"""API views for teams, quotas, members, service accounts, tokens and the audit log."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts import selectors, services
from apps.accounts.api import serializers as s
from apps.accounts.filtersets import (
    ApiTokenFilterSet,
    AuditEventFilterSet,
    MembershipFilterSet,
    ServiceAccountFilterSet,
    TeamFilterSet,
    TeamQuotaFilterSet,
    TeamSecretFilterSet,
)
from apps.accounts.models import ApiToken, TokenScope
from controlplane.api import ServiceViewSet


class MeView(APIView):
    """Who the caller is: roles, teams, and the token's scopes (for `cpctl whoami`)."""

    @extend_schema(responses=s.MeSerializer)
    def get(self, request):
        return Response(s.MeSerializer.describe(request))


class TeamViewSet(ServiceViewSet):
    serializer_class = s.TeamSerializer
    filterset_class = TeamFilterSet
    ordering_fields = ["name", "created_at"]
    create_service = services.team_create
    update_service = services.team_update
    delete_service = services.team_delete
    instance_kwarg = "team"

    def get_queryset(self):
        return selectors.teams_visible_to(user=self.request.user).prefetch_related("quotas")


class TeamQuotaViewSet(ServiceViewSet):
    filterset_class = TeamQuotaFilterSet
    ordering_fields = ["gpu_type", "max_gpus"]
    create_service = services.team_quota_set
    delete_service = services.team_quota_delete
    instance_kwarg = "quota"

    def get_queryset(self):
        return selectors.quotas_visible_to(user=self.request.user)

    def get_serializer_class(self):
        if self.action in ("update", "partial_update"):
            return s.TeamQuotaUpdateSerializer
        return s.TeamQuotaSerializer

    def perform_update(self, serializer):
        quota = serializer.instance
        serializer.instance = services.team_quota_set(
            team=quota.team,
            gpu_type=quota.gpu_type,
            max_gpus=serializer.validated_data.get("max_gpus", quota.max_gpus),
            by=self.request.user,
        )


class MembershipViewSet(ServiceViewSet):
    filterset_class = MembershipFilterSet
    ordering_fields = ["role", "created_at"]
    create_service = services.membership_create
    update_service = services.membership_update
    delete_service = services.membership_delete
    instance_kwarg = "membership"

    def get_queryset(self):
        return selectors.memberships_visible_to(user=self.request.user)

    def get_serializer_class(self):
        if self.action in ("update", "partial_update"):
            return s.MembershipUpdateSerializer
        return s.MembershipSerializer

    def perform_update(self, serializer):
        membership = serializer.instance
        serializer.instance = services.membership_update(
            membership=membership,
            role=serializer.validated_data.get("role", membership.role),
            by=self.request.user,
        )


class ServiceAccountViewSet(
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.ListModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    serializer_class = s.ServiceAccountSerializer
    filterset_class = ServiceAccountFilterSet
    ordering_fields = ["name", "created_at"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return selectors.service_accounts_visible_to(user=self.request.user)

    def perform_create(self, serializer):
        serializer.instance = services.service_account_create(
            by=self.request.user, **serializer.validated_data
        )

    def perform_destroy(self, instance):
        services.service_account_delete(account=instance, by=self.request.user)


class ApiTokenViewSet(
    mixins.CreateModelMixin,
    mixins.RetrieveModelMixin,
    mixins.ListModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Tokens: the secret is in the create answer only. DELETE revokes (the row stays)."""

    serializer_class = s.ApiTokenSerializer
    filterset_class = ApiTokenFilterSet
    ordering_fields = ["created_at", "last_used_at"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex
    required_scope = TokenScope.ADMIN

    def get_queryset(self):
        return selectors.tokens_visible_to(user=self.request.user)

    @extend_schema(request=s.ApiTokenSerializer, responses={201: s.ApiTokenCreatedSerializer})
    def create(self, request, *args, **kwargs):
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        account = data.pop("service_account", None)
        token, secret = services.api_token_create(
            user=account.user if account is not None else request.user,
            by=request.user,
            parent=request.auth if isinstance(request.auth, ApiToken) else None,
            **data,
        )
        token.token = secret
        body = s.ApiTokenCreatedSerializer(token, context=self.get_serializer_context()).data
        return Response(body, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.api_token_revoke(token=instance, by=self.request.user)


class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = s.AuditEventSerializer
    filterset_class = AuditEventFilterSet
    ordering_fields = ["at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return selectors.audit_events_visible_to(user=self.request.user)


class TeamSecretViewSet(ServiceViewSet):
    """Team secrets by name. POST sets one (or replaces its value); values are never returned."""

    filterset_class = TeamSecretFilterSet
    ordering_fields = ["name", "updated_at"]
    create_service = services.team_secret_set
    delete_service = services.team_secret_delete
    instance_kwarg = "secret"

    def get_queryset(self):
        return selectors.team_secrets_visible_to(user=self.request.user)

    def get_serializer_class(self):
        if self.action in ("update", "partial_update"):
            return s.TeamSecretUpdateSerializer
        return s.TeamSecretSerializer

    def perform_update(self, serializer):
        secret = serializer.instance
        serializer.instance = services.team_secret_set(
            team=secret.team,
            name=secret.name,
            value=serializer.validated_data.get("value", ""),
            by=self.request.user,
        )
