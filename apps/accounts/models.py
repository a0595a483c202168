"""Teams, who belongs to them and with which role, API tokens, and the audit log."""

import uuid

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q

GPU_TYPES = [("H100", "H100"), ("H200", "H200"), ("A100", "A100")]

slug_validator = RegexValidator(
    r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$",
    "Use lowercase letters, digits and inner hyphens (at most 50 characters).",
)


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    slug = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    description = models.TextField(blank=True, max_length=2000)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class TeamQuota(models.Model):
    """How many GPUs of one type a team may hold at once (enforced by the scheduler)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="quotas")
    gpu_type = models.CharField(max_length=10, choices=GPU_TYPES)
    max_gpus = models.PositiveIntegerField(
        validators=[MinValueValidator(0)], help_text="Nominal: guaranteed to the team."
    )
    borrow_gpus = models.PositiveIntegerField(
        default=0, help_text="How many more it may borrow from others' idle capacity."
    )

    class Meta:
        ordering = ["team__name", "gpu_type"]
        constraints = [
            models.UniqueConstraint(fields=["team", "gpu_type"], name="one_quota_per_team_gpu_type")
        ]

    def __str__(self) -> str:
        return f"{self.team}: {self.max_gpus} × {self.gpu_type}"


class TeamRole(models.TextChoices):
    ADMIN = "admin", "Team admin"
    RESEARCHER = "researcher", "Researcher"
    VIEWER = "viewer", "Viewer"


SERVICE_ACCOUNT_ROLES = [
    (TeamRole.RESEARCHER.value, TeamRole.RESEARCHER.label),
    (TeamRole.VIEWER.value, TeamRole.VIEWER.label),
]


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=TeamRole.choices, default=TeamRole.RESEARCHER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["user", "team"], name="one_membership_per_user_team")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} as {self.role}"


class OrgRoleName(models.TextChoices):
    OPS = "ops", "Ops (manage the fleet)"
    FINANCE = "finance", "Finance (read all costs; write budgets and prices)"


class OrgRole(models.Model):
    """A role across every team: ops run the fleet, finance reads every team's spend."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="org_roles"
    )
    role = models.CharField(max_length=20, choices=OrgRoleName.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["role", "user__username"]
        constraints = [models.UniqueConstraint(fields=["user", "role"], name="one_org_role_each")]

    def __str__(self) -> str:
        return f"{self.user} is {self.role}"


class ServiceAccount(models.Model):
    """A robot user for CI, owned by a team; it acts through API tokens only."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="service_account"
    )
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="service_accounts")
    name = models.CharField(max_length=50, validators=[slug_validator])
    description = models.TextField(blank=True, max_length=2000)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="service_account_name_per_team")
        ]

    def __str__(self) -> str:
        return f"{self.team.slug}/{self.name}"


class TokenScope(models.TextChoices):
    READ = "read", "Read"
    SUBMIT = "submit", "Submit and cancel jobs"
    ADMIN = "admin", "Every write the owner's role allows"


class ApiToken(models.Model):
    """A bearer token. Only the SHA-256 of its secret is kept; the secret is shown once.

    A SHA-256 of 256 random bits cannot be brute-forced, so it needs no slow
    password hash (which would cost hundreds of milliseconds on every request).
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="First characters, to recognise a token.")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    parent = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="children",
        editable=False,
        help_text="The token that made this one (none: made in a browser session). "
        "A token never outlives, nor holds more scopes than, its parent.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class AuditEvent(models.Model):
    """One write, whoever made it: append-only, written by the services."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_label = models.CharField(max_length=150, help_text="Username, or the task that acted.")
    channel = models.CharField(max_length=20, help_text="api, page, admin, task or cli.")
    action = models.CharField(max_length=100, db_index=True)
    object_type = models.CharField(max_length=100)
    object_id = models.CharField(max_length=64)
    object_repr = models.CharField(max_length=200)
    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events"
    )
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    address = models.GenericIPAddressField(null=True, blank=True)
    request_id = models.UUIDField(default=uuid.uuid4, editable=False)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"])]
        constraints = [
            models.CheckConstraint(condition=~Q(action=""), name="audit_action_not_empty"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.object_repr}"


class TeamSecret(models.Model):
    """A team's secret (an API key, a token), stored encrypted; jobs name it, nodes get it.

    The value is never shown again after it is set: not in the API, the pages,
    the audit log or job logs (where the node agent masks it).
    """

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="secrets")
    name = models.CharField(
        max_length=128,
        validators=[RegexValidator(r"^[A-Za-z_][A-Za-z0-9_]*$", "An environment variable name.")],
    )
    ciphertext = models.BinaryField(editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["team__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="secret_name_per_team")
        ]

    def __str__(self) -> str:
        return f"{self.team.slug}/{self.name}"
