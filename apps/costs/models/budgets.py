"""Teams' monthly budgets and the alerts sent as their spend crosses 50, 80 and 100%."""

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models

from apps.costs.money import MoneyField
from apps.outbox.models import WebhookCall

THRESHOLDS = (50, 80, 100)


class Budget(models.Model):
    """A team's monthly limit (months in COSTS_TIME_ZONE). At 100% the team's jobs stop
    bursting to the cloud, and with `stop_submissions` new jobs are refused too."""

    team = models.OneToOneField("accounts.Team", on_delete=models.CASCADE, related_name="budget")
    monthly_limit = models.DecimalField(
        max_digits=14, decimal_places=2, validators=[MinValueValidator(0)]
    )
    stop_submissions = models.BooleanField(
        default=False, help_text="At 100%, refuse the team's new jobs as well."
    )
    notify_emails = models.CharField(
        max_length=1000,
        blank=True,
        help_text="Comma-separated addresses alerted besides the team's admins.",
    )
    webhook_url = models.URLField(max_length=1000, blank=True)
    webhook_signing_key = models.BinaryField(editable=False, blank=True, default=b"")
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name"]

    def __str__(self) -> str:
        return f"{self.team}: {self.monthly_limit} a month"


WEBHOOK_STATES = [("none", "No webhook"), *WebhookCall.State.choices]


class BudgetAlert(models.Model):
    """A threshold a team crossed in a month: one row each, so each notifies once."""

    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    month = models.DateField(help_text="The first day of the month.")
    threshold = models.PositiveSmallIntegerField(choices=[(t, f"{t}%") for t in THRESHOLDS])
    spent = MoneyField()
    monthly_limit = models.DecimalField(max_digits=14, decimal_places=2)
    at = models.DateTimeField()
    emailed_to = models.CharField(max_length=1000, blank=True)
    webhook_call = models.OneToOneField(
        WebhookCall,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The call to the budget's webhook, where it had one.",
    )

    class Meta:
        ordering = ["-at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["team", "month", "threshold"], name="budget_alert_once")
        ]

    def __str__(self) -> str:
        return f"{self.team}: {self.threshold}% of {self.month:%Y-%m}"

    @property
    def webhook_state(self) -> str:
        """The call's state (pending, delivered, failed, dropped), or none."""
        return self.webhook_call.state if self.webhook_call else "none"

    @property
    def webhook_attempts(self) -> int:
        return self.webhook_call.attempts if self.webhook_call else 0
