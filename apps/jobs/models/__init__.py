"""Jobs, their history and allocations, reservations, and the teams' decayed usage."""

from apps.jobs.models.jobs import (
    Allocation,
    Job,
    JobEvent,
    JobKind,
    JobState,
    Placement,
    PriorityClass,
)
from apps.jobs.models.reservations import Reservation
from apps.jobs.models.usage import TeamUsage
from apps.jobs.models.webhooks import Webhook, WebhookDelivery

__all__ = [
    "Allocation",
    "Job",
    "JobEvent",
    "JobKind",
    "JobState",
    "Placement",
    "PriorityClass",
    "Reservation",
    "TeamUsage",
    "Webhook",
    "WebhookDelivery",
]
