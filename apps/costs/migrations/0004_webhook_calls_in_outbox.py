# Budget alerts' webhook calls move to the one outbox of webhook calls (apps/outbox): each
# alert that had a call points at its row, which keeps the call's state and attempts.

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def move_to_outbox(apps, schema_editor):
    BudgetAlert = apps.get_model("costs", "BudgetAlert")
    Budget = apps.get_model("costs", "Budget")
    WebhookCall = apps.get_model("outbox", "WebhookCall")
    budgets = {b.team_id: b for b in Budget.objects.all()}
    for alert in BudgetAlert.objects.exclude(webhook_state="none").select_related("team"):
        budget = budgets.get(alert.team_id)
        if budget is None or not budget.webhook_url:
            continue
        alert.webhook_call = WebhookCall.objects.create(
            team_id=alert.team_id,
            topic="budget.alert",
            source=f"budget:{budget.pk}",
            url=budget.webhook_url,
            signing_key=budget.webhook_signing_key,
            payload={
                "team": alert.team.slug,
                "team_id": alert.team_id,
                "month": f"{alert.month:%Y-%m}",
                "threshold_percent": alert.threshold,
                "spent": str(round(alert.spent, 2)),
                "monthly_limit": str(alert.monthly_limit),
                "currency": settings.COSTS_CURRENCY,
                "at": alert.at.isoformat(),
            },
            state=alert.webhook_state,
            attempts=alert.webhook_attempts,
            next_attempt_at=alert.webhook_next_at if alert.webhook_state == "pending" else None,
            last_error=alert.webhook_last_error,
        )
        alert.save(update_fields=["webhook_call"])


class Migration(migrations.Migration):
    dependencies = [
        ("costs", "0003_monthly_spend"),
        ("outbox", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="budgetalert",
            name="webhook_call",
            field=models.OneToOneField(
                blank=True,
                help_text="The call to the budget's webhook, where it had one.",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="outbox.webhookcall",
            ),
        ),
        migrations.RunPython(move_to_outbox, migrations.RunPython.noop),
        migrations.RemoveField(model_name="budgetalert", name="webhook_attempts"),
        migrations.RemoveField(model_name="budgetalert", name="webhook_last_error"),
        migrations.RemoveField(model_name="budgetalert", name="webhook_next_at"),
        migrations.RemoveField(model_name="budgetalert", name="webhook_state"),
    ]
