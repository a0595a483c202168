# The job webhooks' deliveries move to the one outbox of webhook calls (apps/outbox); calls
# still owed go with them, so none is lost in the upgrade.

from django.db import migrations


def move_to_outbox(apps, schema_editor):
    WebhookDelivery = apps.get_model("jobs", "WebhookDelivery")
    WebhookCall = apps.get_model("outbox", "WebhookCall")
    calls = [
        WebhookCall(
            team_id=d.webhook.team_id,
            topic="job.finished",
            source=f"webhook:{d.webhook_id}",
            url=d.webhook.url,
            signing_key=d.webhook.signing_key,
            payload=d.payload,
            state=d.state,
            attempts=d.attempts,
            next_attempt_at=d.next_attempt_at if d.state == "pending" else None,
            last_status=d.last_status,
            last_error=d.last_error,
            delivered_at=d.delivered_at,
        )
        for d in WebhookDelivery.objects.select_related("webhook").iterator()
    ]
    WebhookCall.objects.bulk_create(calls, batch_size=1000)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0017_run_evidence"),
        ("outbox", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(move_to_outbox, migrations.RunPython.noop),
        migrations.DeleteModel(name="WebhookDelivery"),
    ]
