"""Reservations of nodes for a time window: a team's deadline, or maintenance (no team)."""

from django.conf import settings
from django.db import models
from django.db.models import F, Q


class Reservation(models.Model):
    name = models.CharField(max_length=100)
    team = models.ForeignKey(
        "accounts.Team",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="reservations",
        help_text="Empty: maintenance (no job runs there).",
    )
    reason = models.CharField(max_length=300)
    nodes = models.ManyToManyField("fleet.Node", related_name="reservations")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["starts_at", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(ends_at__gt=F("starts_at")), name="reservation_ends_after_start"
            ),
        ]

    def __str__(self) -> str:
        return self.name
