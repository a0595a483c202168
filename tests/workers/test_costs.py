"""The costs tasks: metering from the jobs' real allocations, spot prices from EC2's
describe_spot_price_history, and budget alerts' signed webhooks.

Spot prices are tested with botocore's Stubber on responses shaped like EC2's (the
Stubber checks them against the service model): moto answers describe_spot_price_history
with made-up prices that never change, which would prove nothing about price changes.
"""

import datetime as dt
import hashlib
import hmac
import json
from decimal import Decimal

import boto3
import pytest
from botocore.stub import Stubber
from django.db.models import Sum
from django.utils import timezone

from apps.costs import services
from apps.costs.models import BudgetAlert, SpotPrice, UsageEntry
from apps.jobs import services as jobs
from apps.jobs.scheduler.run import scheduling_pass
from apps.outbox.models import WebhookCall
from controlplane.celery import app
from tests.apps.costs.conftest import (
    cloud_node,
    cloud_pool,
    cloud_price,
    owned_price,
)
from tests.apps.jobs.conftest import command_spec, fleet_pool, quota  # noqa: F401 (fixtures)
from tests.apps.jobs.test_webhooks import receiver  # noqa: F401 (a fixture)
from tests.workers.providers.test_aws import config_for
from workers.providers.aws import AwsProvider
from workers.tasks.costs import meter, meter_run, spot_prices_fetch
from workers.tasks.outbox import deliver

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _budget_state_forgotten():
    """The budget boundary keeps its answer a few seconds in-process: not past this test."""
    from apps.costs.selectors import forget_budget_state

    forget_budget_state()
    yield
    forget_budget_state()


def test_metering_reads_the_jobs_allocations_and_attributes_them(
    fleet_pool,  # noqa: F811
    quota,  # noqa: F811
    team,
    researcher,
):
    owned_price(fleet_pool, since=timezone.now() - dt.timedelta(days=1))
    job, _ = jobs.job_submit(
        team=team,
        spec=command_spec(team, resources={"gpu_type": "H100", "gpus": 4}),
        submitted_by=researcher,
    )
    scheduling_pass()
    held = job.allocations.get()

    result = meter_run(until=held.started_at + dt.timedelta(hours=1))

    assert result["rows"] >= 5  # the job's half of one node, its idle half, three idle nodes
    rows = UsageEntry.objects.filter(node_id=held.node_id, start__gte=held.started_at)
    # Rows never cross a local midnight: within an hour of one, the hour is two rows.
    mine = list(rows.filter(job=job))
    assert {(m.team_id, m.gpus, m.node_gpus) for m in mine} == {(team.pk, 4, 8)}
    assert len(mine) in (1, 2)
    assert abs(sum(m.amount for m in mine) - Decimal("12.121644") / 2) <= Decimal("0.000001")
    assert set(rows.filter(kind="idle").values_list("gpus", flat=True)) == {4}


def test_the_meter_task_runs_one_at_a_time(fleet_pool):  # noqa: F811
    from workers.tasks.locks import single_flight

    with single_flight("costs.meter", ttl_s=60):
        assert meter.apply().get() == {"skipped": "another metering run is going"}
    assert "rows" in meter.apply().get()


def spot_entry(zone: str, price: str, when: dt.datetime) -> dict:
    return {
        "AvailabilityZone": zone,
        "InstanceType": "p5.48xlarge",
        "ProductDescription": "Linux/UNIX",
        "SpotPrice": price,
        "Timestamp": when,
    }


def test_spot_prices_are_stored_with_their_times_and_priced_into_spot_nodes():
    pool = cloud_pool("aws-spot")
    cloud_price("55.04", since=timezone.now() - dt.timedelta(days=30))
    now = dt.datetime(2026, 11, 20, 12, tzinfo=dt.UTC)
    client = boto3.client(
        "ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y"
    )
    provider = AwsProvider(config_for(), ec2=client)
    with Stubber(client) as stubber:
        stubber.add_response(
            "describe_spot_price_history",
            {
                "SpotPriceHistory": [
                    spot_entry("us-east-1a", "21.500000", now - dt.timedelta(hours=30)),
                    spot_entry("us-east-1b", "19.750000", now - dt.timedelta(hours=5)),
                    spot_entry("us-east-1a", "24.000000", now - dt.timedelta(hours=2)),
                ],
                "NextToken": "",
            },
            {
                "InstanceTypes": ["p5.48xlarge"],
                "ProductDescriptions": ["Linux/UNIX"],
                "StartTime": now - dt.timedelta(days=1),
            },
        )
        stubber.add_response(
            "describe_spot_price_history",
            {
                "SpotPriceHistory": [
                    spot_entry("us-east-1a", "24.000000", now - dt.timedelta(hours=2))
                ]
            },
            {
                "InstanceTypes": ["p5.48xlarge"],
                "ProductDescriptions": ["Linux/UNIX"],
                "StartTime": now - dt.timedelta(hours=2),
            },
        )
        first = spot_prices_fetch(provider_for=lambda region: provider, now=now)
        again = spot_prices_fetch(provider_for=lambda region: provider, now=now)
        stubber.assert_no_pending_responses()

    assert first == {"us-east-1/p5.48xlarge": 3} and again == {"us-east-1/p5.48xlarge": 0}
    assert SpotPrice.objects.filter(availability_zone="us-east-1a").count() == 2

    node = cloud_node(pool, launched=now - dt.timedelta(hours=4), capacity="spot")
    from tests.apps.costs.conftest import meter as meter_until

    meter_until(until=now)
    rates = list(
        UsageEntry.objects.filter(node=node)
        .order_by("start")
        .values_list("rate_per_hour", flat=True)
    )
    # 4 h ago the dearest zone asked 21.50; from 2 h ago, 24.00.
    assert rates == [Decimal("21.5"), Decimal("24")]
    assert UsageEntry.objects.filter(node=node).aggregate(s=Sum("amount"))["s"] == Decimal(91)


def test_budget_alert_webhooks_are_signed_like_job_webhooks(team, receiver):  # noqa: F811
    from tests.apps.costs.test_budgets import spend

    _, key = services.budget_set(
        team=team, monthly_limit=Decimal(10), by=None, webhook_url=receiver["url"]
    )
    spend(team, Decimal(6))
    services.budgets_check()
    receiver["answers"].append(503)

    first = deliver.apply().get()
    alert = BudgetAlert.objects.get()
    later = deliver.apply().get()  # the retry waits its turn
    WebhookCall.objects.filter(pk=alert.webhook_call_id).update(next_attempt_at=timezone.now())
    delivered = deliver.apply().get()

    assert first["retrying"] == 1 and later["retrying"] == 0 and delivered["delivered"] == 1
    headers, body, _ = receiver["calls"][-1]
    expected = "sha256=" + hmac.new(key.encode(), body, hashlib.sha256).hexdigest()
    assert headers["X-Controlplane-Signature"] == expected
    payload = json.loads(body)
    assert (payload["team"], payload["threshold_percent"]) == (team.slug, 50)
    alert.refresh_from_db()
    assert (alert.webhook_state, alert.webhook_attempts) == (WebhookCall.State.DELIVERED, 2)


def test_the_beat_runs_the_costs_tasks(settings):
    schedule = app.conf.beat_schedule
    assert schedule["costs-meter"]["task"] == "costs.meter"
    assert schedule["costs-meter"]["schedule"] == float(settings.COSTS_METER_EVERY_S)
    assert schedule["costs-spot-prices"]["task"] == "costs.spot_prices"
    assert schedule["outbox-deliver"]["task"] == "outbox.deliver"
    for name in ("costs.meter", "costs.spot_prices", "outbox.deliver"):
        assert app.tasks[name].acks_late is True
