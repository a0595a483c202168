"""Webhooks: an HTTPS endpoint a team (or one job) is called on when a job ends."""

from django.conf import settings
from django.db import models

from controlplane import webhooks


class Webhook(models.Model):
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="webhooks")
    job = models.ForeignKey(
        "jobs.Job",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="webhooks",
        help_text="Empty: every job of the team.",
    )
    url = models.URLField(max_length=1000, validators=[webhooks.validate_url])
    signing_key = models.BinaryField(editable=False, help_text="Encrypted; signs each call.")
    active = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "id"]

    def __str__(self) -> str:
        return f"{self.team.slug} → {self.url}"
