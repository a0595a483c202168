"""Costs: metering the fleet into the ledger, spot prices from EC2.

costs.meter                    every COSTS_METER_EVERY_S: the jobs' allocations are read
                               here (tasks sit above every app) and handed to costs'
                               metering service; then budgets are checked and jobs past
                               their max_cost_usd are stopped with a checkpoint
costs.spot_prices              every COSTS_SPOT_PRICES_EVERY_S: describe_spot_price_history
                               for each spot-capable cloud pool's instance types
"""

import datetime as dt
import logging

from celery import shared_task
from django.utils import timezone

from workers.tasks.locks import single_flight

log = logging.getLogger(__name__)


def allocations_read(*, node_ids, since, until):
    """The jobs' allocations on these nodes overlapping [since, until), as costs reads them."""
    from apps.costs.services import Held
    from apps.jobs.selectors import allocations_overlapping

    return [
        Held(
            node_id=node_id,
            job_id=job_id,
            team_id=team_id,
            gpus=gpus,
            started_at=started_at,
            ended_at=ended_at,
        )
        for node_id, job_id, team_id, gpus, started_at, ended_at in allocations_overlapping(
            node_ids=node_ids, since=since, until=until
        )
    ]


def meter_run(*, until: dt.datetime | None = None) -> dict:
    """Meter, then act on what the new figures say: budget alerts, jobs at their cost limit."""
    from apps.costs.services import budgets_check, usage_meter
    from apps.jobs.services import jobs_cost_limit_stop

    report = usage_meter(allocations_for=allocations_read, until=until)
    alerts = budgets_check()
    stopped = jobs_cost_limit_stop()
    return {
        "until": report.until.isoformat() if report.until else None,
        "nodes": report.nodes,
        "rows": report.rows,
        "corrections": report.corrections,
        "amount": str(report.amount),
        "alerts": len(alerts),
        "stopped": stopped,
    }


@shared_task(name="costs.meter", acks_late=True, reject_on_worker_lost=True)
def meter() -> dict:
    from apps.accounts.context import Origin, acting_from

    with single_flight("costs.meter", ttl_s=900) as got_it:
        if not got_it:
            return {"skipped": "another metering run is going"}
        with acting_from(Origin(channel="task", label="task:costs.meter")):
            result = meter_run()
    if result["alerts"] or result["stopped"]:
        log.info("metering: %s", result)
    return result


def spot_prices_fetch(*, provider_for=None, now: dt.datetime | None = None) -> dict:
    """Read new spot prices for every spot-capable cloud pool's instance types, from the
    newest one stored (a day back the first time), and store them with their times."""
    from apps.costs.selectors import spot_price_targets
    from apps.costs.services import SpotQuote, spot_prices_record
    from workers.providers.aws import AwsProvider
    from workers.providers.errors import ProviderError
    from workers.tasks.aws_nodes import aws_config

    now = now or timezone.now()
    provider_for = provider_for or (lambda region: AwsProvider(aws_config(region)))
    stored = {}
    for region, instance_type, newest in spot_price_targets():
        since = newest or now - dt.timedelta(days=1)
        try:
            prices = provider_for(region).spot_prices(instance_type, since, region=region)
        except ProviderError as exc:
            log.warning("spot prices of %s in %s: %s", instance_type, region, exc)
            continue
        stored[f"{region}/{instance_type}"] = spot_prices_record(
            region=region,
            quotes=[
                SpotQuote(
                    availability_zone=p.availability_zone,
                    instance_type=p.instance_type,
                    per_hour=p.price_per_hour,
                    effective_at=p.timestamp,
                )
                for p in prices
            ],
        )
    return stored


@shared_task(name="costs.spot_prices", acks_late=True, reject_on_worker_lost=True)
def spot_prices() -> dict:
    with single_flight("costs.spot_prices", ttl_s=600) as got_it:
        if not got_it:
            return {"skipped": "another fetch is going"}
        return spot_prices_fetch()
