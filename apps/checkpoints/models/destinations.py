"""Where checkpoints get their second copy: an S3 bucket and prefix per team or per pool."""

from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

BUCKET_NAME = RegexValidator(
    r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
    "3 to 63 lowercase letters, digits, dots and hyphens, starting and ending with a letter "
    "or digit (S3's bucket naming rules).",
)
PREFIX = RegexValidator(
    r"^[A-Za-z0-9!_.*'()/-]*$", "Letters, digits and S3's safe characters ! _ . * ' ( ) / -."
)


class S3Destination(models.Model):
    """A team's destination wins over its job's pool's; without either, the settings'
    CHECKPOINT_S3_BUCKET (empty: no S3 copy). Keys: <prefix>/<team>/job-<id>/step-…/<file>."""

    team = models.OneToOneField(
        "accounts.Team", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    pool = models.OneToOneField(
        "fleet.NodePool", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    bucket = models.CharField(max_length=63, validators=[BUCKET_NAME])
    prefix = models.CharField(max_length=512, blank=True, validators=[PREFIX])
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=(Q(team__isnull=False) & Q(pool__isnull=True))
                | (Q(team__isnull=True) & Q(pool__isnull=False)),
                name="s3_destination_for_a_team_or_a_pool",
            ),
        ]

    def __str__(self) -> str:
        whose = f"team {self.team_id}" if self.team_id else f"pool {self.pool_id}"
        return f"s3://{self.bucket}/{self.prefix} for {whose}"
