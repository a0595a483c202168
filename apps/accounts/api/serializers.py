"""JSON shapes of teams, memberships, service accounts, tokens and audit events."""

from django.contrib.auth import get_user_model
from rest_framework import serializers

from apps.accounts.models import (
    SERVICE_ACCOUNT_ROLES,
    ApiToken,
    AuditEvent,
    Membership,
    ServiceAccount,
    Team,
    TeamQuota,
    TeamRole,
    TeamSecret,
    TokenScope,
)
from apps.accounts.selectors import (
    roles_of,
    service_accounts_visible_to,
    teams_visible_to,
    users_visible_to,
)
from controlplane.api import ScopedPrimaryKeyField, StrictModelSerializer, StrictSerializer, Text

User = get_user_model()


class QuotaInTeamSerializer(StrictModelSerializer):
    class Meta:
        model = TeamQuota
        fields = ["gpu_type", "max_gpus"]


class TeamSerializer(StrictModelSerializer):
    quotas = QuotaInTeamSerializer(many=True, read_only=True)

    class Meta:
        model = Team
        fields = ["id", "name", "slug", "description", "quotas", "created_at"]
        read_only_fields = ["created_at"]


class TeamQuotaSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to)

    class Meta:
        model = TeamQuota
        fields = ["id", "team", "gpu_type", "max_gpus"]
        validators = []  # the service upserts on (team, gpu_type)


class TeamQuotaUpdateSerializer(StrictModelSerializer):
    class Meta:
        model = TeamQuota
        fields = ["id", "team", "gpu_type", "max_gpus"]
        read_only_fields = ["team", "gpu_type"]


class UsernameField(serializers.SlugRelatedField):
    def __init__(self, **kwargs):
        super().__init__(slug_field="username", **kwargs)

    def get_queryset(self):
        return users_visible_to(user=self.context["request"].user)

    def to_internal_value(self, data):
        if not isinstance(data, str) or "\x00" in data:
            self.fail("invalid")
        return super().to_internal_value(data)


class MembershipSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to)
    user = UsernameField()

    class Meta:
        model = Membership
        fields = ["id", "team", "user", "role", "created_at"]
        read_only_fields = ["created_at"]
        validators = []  # the service answers "already a member" with the field named


class MembershipUpdateSerializer(StrictModelSerializer):
    user = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "team", "user", "role", "created_at"]
        read_only_fields = ["team", "created_at"]


class ServiceAccountSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to)
    username = serializers.CharField(source="user.username", read_only=True)
    role = serializers.ChoiceField(
        choices=SERVICE_ACCOUNT_ROLES, default=TeamRole.RESEARCHER, write_only=True
    )

    class Meta:
        model = ServiceAccount
        fields = ["id", "team", "name", "description", "username", "role", "created_at"]
        read_only_fields = ["created_at"]
        validators = []


class ApiTokenSerializer(StrictModelSerializer):
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=TokenScope.choices), min_length=1, max_length=3
    )
    service_account = ScopedPrimaryKeyField(
        selector=service_accounts_visible_to,
        required=False,
        allow_null=True,
        write_only=True,
        help_text="Make the token for this service account (you must admin its team).",
    )
    username = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "username",
            "service_account",
            "scopes",
            "parent",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
        ]
        read_only_fields = ["prefix", "parent", "created_at", "last_used_at", "revoked_at"]


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(
        read_only=True, help_text="The secret. Shown this once; only its SHA-256 is kept."
    )

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]


class AuditEventSerializer(StrictModelSerializer):
    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "at",
            "actor",
            "actor_label",
            "channel",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "team",
            "before",
            "after",
            "address",
            "request_id",
        ]
        read_only_fields = fields


class MeTeamSerializer(StrictSerializer):
    id = serializers.IntegerField(read_only=True)
    slug = Text(read_only=True)
    role = serializers.ChoiceField(choices=TeamRole.choices, read_only=True)


class MeSerializer(StrictSerializer):
    username = Text(read_only=True)
    superuser = serializers.BooleanField(read_only=True)
    org_roles = serializers.ListField(child=serializers.CharField(), read_only=True)
    teams = MeTeamSerializer(
        many=True, read_only=True, help_text="Your teams and your role in each."
    )
    token_scopes = serializers.ListField(
        child=serializers.CharField(), allow_null=True, read_only=True
    )

    @staticmethod
    def describe(request) -> dict:
        user = request.user
        roles = roles_of(user)
        teams = Team.objects.filter(id__in=roles.team_ids).order_by("name")
        token = request.auth if isinstance(request.auth, ApiToken) else None
        return {
            "username": user.get_username(),
            "superuser": roles.superuser,
            "org_roles": [
                name for name, held in (("ops", roles.ops), ("finance", roles.finance)) if held
            ],
            "teams": [{"id": t.id, "slug": t.slug, "role": roles.team_roles[t.id]} for t in teams],
            "token_scopes": token.scopes if token else None,
        }


class TeamSecretSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to)
    value = Text(
        write_only=True,
        max_length=65536,
        help_text="The secret itself: stored encrypted, never shown again.",
    )

    class Meta:
        model = TeamSecret
        fields = ["id", "team", "name", "value", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        validators = []  # setting an existing name replaces its value


class TeamSecretUpdateSerializer(StrictModelSerializer):
    value = Text(write_only=True, max_length=65536)

    class Meta:
        model = TeamSecret
        fields = ["id", "team", "name", "value", "created_at", "updated_at"]
        read_only_fields = ["team", "name", "created_at", "updated_at"]
