"""The one outbox of webhook calls: jobs' and budgets' calls alike are owed in the change's
transaction, sent by one task, dropped when their endpoint goes, and carried over from the
old per-app tables by the migrations."""

import datetime as dt
from decimal import Decimal

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from apps.costs import services as costs
from apps.costs.models import BudgetAlert
from apps.jobs import services as jobs
from apps.outbox.models import WebhookCall
from apps.outbox.services import calls_send
from tests.apps.costs.test_budgets import spend
from tests.apps.jobs.conftest import command_spec
from tests.apps.jobs.test_webhooks import receiver  # noqa: F401  (a fixture)


@pytest.mark.django_db
def test_job_and_budget_calls_share_the_outbox_and_one_sender(
    fleet_pool,
    quota,
    team,
    team_admin,
    researcher,
    receiver,  # noqa: F811
    api_for,
):
    jobs.webhook_create(team=team, url=receiver["url"], by=team_admin)
    costs.budget_set(team=team, monthly_limit=Decimal(10), by=None, webhook_url=receiver["url"])
    job, _ = jobs.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    jobs.job_cancel(job=job, by=researcher)
    spend(team, Decimal(6))
    costs.budgets_check()

    assert sorted(WebhookCall.objects.values_list("topic", flat=True)) == [
        "budget.alert",
        "job.finished",
    ]
    assert calls_send() == {"delivered": 2, "retrying": 0, "failed": 0}
    assert len(receiver["calls"]) == 2
    assert BudgetAlert.objects.get().webhook_state == WebhookCall.State.DELIVERED
    alerts = api_for(team_admin).get("/api/v1/budget-alerts/", {"webhook_state": "delivered"})
    assert [(a["webhook_state"], a["webhook_attempts"]) for a in alerts.json()["results"]] == [
        ("delivered", 1)
    ]
    none = api_for(team_admin).get("/api/v1/budget-alerts/", {"webhook_state": "none"})
    assert none.json()["results"] == []


@pytest.mark.django_db
def test_a_removed_webhook_or_a_moved_budget_address_is_not_called(
    fleet_pool,
    quota,
    team,
    team_admin,
    researcher,
    receiver,  # noqa: F811
):
    hook, _ = jobs.webhook_create(team=team, url=receiver["url"], by=team_admin)
    costs.budget_set(team=team, monthly_limit=Decimal(10), by=None, webhook_url=receiver["url"])
    job, _ = jobs.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    jobs.job_cancel(job=job, by=researcher)
    spend(team, Decimal(6))
    costs.budgets_check()

    jobs.webhook_delete(webhook=hook, by=team_admin)
    elsewhere = receiver["url"].replace("/hook", "/elsewhere")
    costs.budget_set(team=team, monthly_limit=Decimal(10), by=None, webhook_url=elsewhere)

    assert calls_send() == {"delivered": 0, "retrying": 0, "failed": 0}
    assert receiver["calls"] == []
    assert set(WebhookCall.objects.values_list("state", flat=True)) == {"dropped"}


@pytest.mark.django_db(transaction=True)
def test_the_migrations_carry_owed_calls_into_the_outbox(team):
    executor = MigrationExecutor(connection)
    before = [("jobs", "0017_run_evidence"), ("costs", "0003_monthly_spend")]
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps
        Webhook = old.get_model("jobs", "Webhook")
        Job = old.get_model("jobs", "Job")
        Delivery = old.get_model("jobs", "WebhookDelivery")
        Budget = old.get_model("costs", "Budget")
        Alert = old.get_model("costs", "BudgetAlert")
        now = timezone.now()

        hook = Webhook.objects.create(
            team_id=team.pk, url="https://hooks.example/j", signing_key=b"k"
        )
        job = Job.objects.create(
            team_id=team.pk,
            name="old",
            kind="command",
            spec={},
            gpu_type="h100",
            nodes=1,
            gpus_per_node=1,
            time_limit_s=60,
            queued_at=now,
        )
        Delivery.objects.create(
            webhook=hook, job=job, payload={"job": job.pk}, attempts=2, next_attempt_at=now
        )
        budget = Budget.objects.create(
            team_id=team.pk,
            monthly_limit=Decimal(10),
            webhook_url="https://hooks.example/b",
            webhook_signing_key=b"b",
        )
        Alert.objects.create(
            team_id=team.pk,
            month=now.date().replace(day=1),
            threshold=50,
            spent=Decimal(6),
            monthly_limit=Decimal(10),
            at=now,
            webhook_state="failed",
            webhook_attempts=8,
        )
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())

    by_topic = {c.topic: c for c in WebhookCall.objects.all()}
    job_call, alert_call = by_topic["job.finished"], by_topic["budget.alert"]
    assert (job_call.source, job_call.url, job_call.state, job_call.attempts) == (
        f"webhook:{hook.pk}",
        "https://hooks.example/j",
        "pending",
        2,
    )
    assert job_call.next_attempt_at == now
    assert (alert_call.source, alert_call.state, alert_call.attempts) == (
        f"budget:{budget.pk}",
        "failed",
        8,
    )
    assert alert_call.payload["threshold_percent"] == 50
    assert BudgetAlert.objects.get().webhook_call_id == alert_call.pk
    assert dt.timedelta(0) <= timezone.now() - alert_call.created_at < dt.timedelta(minutes=5)
