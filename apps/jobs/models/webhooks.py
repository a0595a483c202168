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


class WebhookDelivery(models.Model):
    """One call owed to a webhook for one finished job; retried until delivered or given up."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Failed"

    id = models.BigAutoField(primary_key=True)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="deliveries")
    payload = models.JSONField()
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    last_status = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["state", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.webhook_id} for job {self.job_id}: {self.state}"
