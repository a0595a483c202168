"""The outbox: every webhook call the control plane owes, whatever it is about.

A row is written in the same transaction as the change it reports (a job that finished, a
budget threshold crossed), so a call is owed exactly when the change happened. The row
carries what the call needs (address, encrypted signing key, body) and is tried until the
receiver answers 2xx or the retry schedule (controlplane/webhooks.py) runs out.
"""

from django.db import models


class WebhookCall(models.Model):
    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Failed"
        DROPPED = "dropped", "Dropped"

    id = models.BigAutoField(primary_key=True)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    topic = models.CharField(max_length=40, help_text="job.finished, budget.alert")
    source = models.CharField(
        max_length=60,
        db_index=True,
        help_text="The endpoint it goes to (webhook:12, budget:3): its pending calls are dropped "
        "when the endpoint is removed or moves.",
    )
    url = models.URLField(max_length=1000)
    signing_key = models.BinaryField(editable=False, help_text="Encrypted; signs the call.")
    payload = models.JSONField()
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["state", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.topic} to {self.source}: {self.state}"
