"""The outbox of webhook calls (apps/outbox): jobs that finished, budget thresholds crossed.

outbox.deliver  every 15 s and soon after a call is owed: sends the due calls, signed, with
                the retry schedule of controlplane/webhooks.py
"""

from celery import shared_task


@shared_task(name="outbox.deliver", acks_late=True, reject_on_worker_lost=True)
def deliver() -> dict:
    from apps.outbox.services import calls_send

    return calls_send()
