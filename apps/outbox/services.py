"""Writes for the outbox: owing calls, sending the due ones, dropping an endpoint's."""

import datetime as dt
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from apps.accounts.secrets import decrypt
from apps.outbox.models import WebhookCall
from controlplane import webhooks
from controlplane.celery import enqueue_on_commit


@dataclass(frozen=True)
class Call:
    """One call owed: the endpoint (`source`, `url`, encrypted `signing_key`) and its body."""

    team_id: int
    topic: str
    source: str
    url: str
    signing_key: bytes
    payload: dict


def calls_owe(calls: list[Call], *, now: dt.datetime | None = None) -> list[WebhookCall]:
    """Write the calls in the caller's transaction; they are sent once it commits."""
    if not calls:
        return []
    now = now or timezone.now()
    rows = WebhookCall.objects.bulk_create(
        [
            WebhookCall(
                team_id=c.team_id,
                topic=c.topic,
                source=c.source,
                url=c.url,
                signing_key=c.signing_key,
                payload=c.payload,
                next_attempt_at=now,
            )
            for c in calls
        ]
    )
    enqueue_on_commit("outbox.deliver", covered_by="the beat")
    return rows


def calls_drop(*, source: str) -> int:
    """The endpoint went away or moved: its pending calls are not sent."""
    return WebhookCall.objects.filter(source=source, state=WebhookCall.State.PENDING).update(
        state=WebhookCall.State.DROPPED, next_attempt_at=None
    )


def calls_send(*, now: dt.datetime | None = None, limit: int = 100) -> dict:
    """Send the calls that are due. Each is claimed for a minute first, so two workers never
    send the same call, and the network wait holds no database lock."""
    now = now or timezone.now()
    with transaction.atomic():
        due = list(
            WebhookCall.objects.select_for_update(skip_locked=True)
            .filter(state=WebhookCall.State.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at")[:limit]
            .values_list("id", flat=True)
        )
        WebhookCall.objects.filter(pk__in=due).update(
            next_attempt_at=now + dt.timedelta(seconds=60)
        )
    counts = {"delivered": 0, "retrying": 0, "failed": 0}
    for call in WebhookCall.objects.filter(pk__in=due):
        status, error = webhooks.attempt(call.url, decrypt(call.signing_key).encode(), call.payload)
        attempts = call.attempts + 1
        if webhooks.answered(status):
            changes = {
                "state": WebhookCall.State.DELIVERED,
                "delivered_at": timezone.now(),
                "next_attempt_at": None,
            }
            counts["delivered"] += 1
        else:
            retry_at = webhooks.next_attempt(attempts, timezone.now())
            if retry_at is None:
                changes = {"state": WebhookCall.State.FAILED, "next_attempt_at": None}
                counts["failed"] += 1
            else:
                changes = {"next_attempt_at": retry_at}
                counts["retrying"] += 1
        error = error or (f"HTTP {status}" if status and not webhooks.answered(status) else "")
        # Only a call still pending is updated: one dropped meanwhile stays dropped.
        WebhookCall.objects.filter(pk=call.pk, state=WebhookCall.State.PENDING).update(
            attempts=attempts, last_status=status, last_error=error[:300], **changes
        )
    return counts
