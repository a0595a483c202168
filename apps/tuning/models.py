"""NCCL profiles: the environment that nodes of one fabric (and NCCL version range) get."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

from apps.accounts.models import slug_validator
from apps.fleet.models import Fabric
from apps.fleet.models.pools import NCCL_VERSION_PATTERN
from apps.tuning import catalogue, linter

ANY_FABRIC = "any"
PROFILE_FABRICS = [(ANY_FABRIC, "Any fabric"), *Fabric.choices]

version_validator = RegexValidator(
    NCCL_VERSION_PATTERN, "An NCCL version such as 2.21.5.", code="invalid"
)


class NcclProfile(models.Model):
    """Ops edit these; every signed-in user reads them. Jobs name one, or get their pool's
    default: the default profile of the pool's fabric whose version range holds the pool's
    NCCL (single-node jobs get the single-node default)."""

    name = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    title = models.CharField(max_length=200)
    description = models.TextField(blank=True, max_length=4000)
    fabric = models.CharField(max_length=20, choices=PROFILE_FABRICS, default=ANY_FABRIC)
    single_node = models.BooleanField(
        default=False, help_text="For jobs that fit on one node: no network between nodes."
    )
    min_nccl_version = models.CharField(
        max_length=20, blank=True, validators=[version_validator], help_text="Empty: any."
    )
    max_nccl_version = models.CharField(
        max_length=20, blank=True, validators=[version_validator], help_text="Empty: any."
    )
    is_default = models.BooleanField(
        default=False,
        help_text="Given to jobs that name no profile, on pools of this fabric and versions.",
    )
    env = models.JSONField(default=dict, blank=True, help_text="Variable name → value.")
    reasons = models.JSONField(
        default=dict, blank=True, help_text="Why a variable the linter warns about is kept."
    )
    built_in = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        editable=False,
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "NCCL profile"

    def __str__(self) -> str:
        return self.name

    def clean(self):
        errors = {}
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            errors["env"] = "A mapping of variable names to text values."
        elif any(not linter.NAME_RE.match(k) for k in self.env):
            errors["env"] = "Variable names are letters, digits and underscores."
        if not isinstance(self.reasons, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.reasons.items()
        ):
            errors["reasons"] = "A mapping of variable names to reasons."
        low, high = self.min_nccl_version, self.max_nccl_version
        if low and high and parse_version(low) > parse_version(high):
            errors["max_nccl_version"] = "Must not be below min_nccl_version."
        if errors:
            raise ValidationError(errors)

    @property
    def lint_context(self) -> linter.Context:
        """Lint against the oldest NCCL the profile claims to fit."""
        fabric = "" if self.fabric == ANY_FABRIC else self.fabric
        return linter.Context(
            fabric=fabric, nccl_version=self.min_nccl_version, single_node=self.single_node
        )

    def lint(self) -> list[linter.Verdict]:
        return linter.lint(self.env or {}, context=self.lint_context, reasons=self.reasons or {})

    def fits(self, nccl_version: str) -> bool:
        """Whether a pool with this NCCL version is inside the profile's range ('' fits)."""
        if not nccl_version:
            return True
        version = parse_version(nccl_version)
        if self.min_nccl_version and not catalogue.version_at_least(version, self.min_nccl_version):
            return False
        return not (self.max_nccl_version and version > parse_version(self.max_nccl_version))


def parse_version(text: str) -> tuple[int, ...]:
    try:
        return catalogue.version_tuple(text)
    except ValueError:
        return ()
