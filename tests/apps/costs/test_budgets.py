"""Budgets: alerts at 50, 80 and 100% once each; at 100% the scheduler's burst path stops,
optionally submissions too, and before that a burst goes only if what it will cost fits in
what is left; a job's max_cost_usd refuses it at submission and stops it, with a
checkpoint, when its metered cost reaches it."""

import datetime as dt
import re
import time
from decimal import Decimal

import pytest
from django.core import mail
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.models import TeamRole
from apps.costs import selectors, services
from apps.costs.models import BudgetAlert
from apps.fleet.models import Node
from apps.jobs import dispatch
from apps.jobs import services as jobs
from apps.jobs.models import Job, JobState
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.apps.costs.conftest import (
    Allocations,
    cloud_node,
    cloud_pool,
    cloud_price,
    meter,
    owned_price,
    spot_price,
)
from tests.apps.jobs.conftest import command_spec
from tests.workers import test_cloud

pytestmark = pytest.mark.django_db


def spend(team, amount: Decimal, *, pool_slug: str = "spend-pool") -> None:
    """Meter `amount` of a team's spend into this month, through the ledger."""
    now = timezone.now()
    start = max(now - dt.timedelta(hours=1), selectors.local_midnight(selectors.month_start()))
    hours = Decimal((now - start).total_seconds()) / 3600
    pool = cloud_pool(f"{pool_slug}-{Node.objects.count()}", region="eu-north-1")
    cloud_price((amount / hours).quantize(Decimal("0.000001")), since=start, region="eu-north-1")
    node = cloud_node(pool, launched=start)
    meter(Allocations([(node.pk, 999, team.pk, 8, start, None)]), until=now)


def test_each_threshold_notifies_once_by_email(team, team_admin):
    team_admin.email = "alice@example.com"
    team_admin.save()
    services.budget_set(
        team=team, monthly_limit=Decimal(100), by=None, notify_emails="finance@example.com"
    )

    spend(team, Decimal(55))
    first = services.budgets_check()
    again = services.budgets_check()
    spend(team, Decimal(50))
    second = services.budgets_check()

    assert [a.threshold for a in first] == [50] and again == []
    assert sorted(a.threshold for a in second) == [80, 100]
    assert BudgetAlert.objects.count() == 3
    assert len(mail.outbox) == 2  # one per check that crossed something
    assert mail.outbox[0].to == ["alice@example.com", "finance@example.com"]
    assert "50%" in mail.outbox[0].subject and "100%" in mail.outbox[1].subject
    assert "no longer burst" in mail.outbox[1].body
    assert BudgetAlert.objects.filter(threshold=100).get().emailed_to


def test_bursting_to_the_cloud_stops_at_100_percent(team):
    pool = test_cloud.cloud_pool()
    cloud_price("8", since=timezone.now() - dt.timedelta(days=1))
    spend(team, Decimal(30))
    services.budget_set(team=team, monthly_limit=Decimal(25), by=None)
    job = test_cloud.waiting_job(team, nodes=1)

    assert jobs.budget_left(team=team.pk) is False
    scheduling_pass()

    assert not Node.objects.filter(burst_job=job).exists()
    job.refresh_from_db()
    assert "budget" in job.pending_reason

    services.budget_set(team=team, monthly_limit=Decimal(1000), by=None)
    scheduling_pass()
    assert Node.objects.filter(burst_job=job, pool=pool).count() == 1


# --- what a burst will cost, held against the budget before it is asked for ---------------------


def burst_pool(*, on_demand: str = "80", spot: str | None = None):
    """A cloud pool of 8-GPU p5.48xlarge nodes in us-east-1 that bursts at once, priced
    per node-hour from yesterday (over the list price the costs migration loads; a spot
    price too, if given). Spend is metered in eu-north-1: these prices never reprice it."""
    pool = test_cloud.cloud_pool()
    yesterday = timezone.now() - dt.timedelta(days=1)
    cloud_price(on_demand, since=yesterday)
    if spot is not None:
        spot_price(spot, when=yesterday)
    return pool


def cloud_job(team, *, spot: bool = False, time_limit_s: int = 3600, **extra) -> Job:
    """A one-node job of 8 H100 for the cloud: at $80 a node-hour, $80 an hour."""
    spec = command_spec(
        team,
        time_limit_s=time_limit_s,
        resources={"gpu_type": "H100", "nodes": 1, "gpus_per_node": 8},
        placement={"where": "cloud", "spot": spot},
        **extra,
    )
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=factories.make_member(team=team))
    return job


def spent_and_budgeted(team, *, spent: int = 30, limit: int = 100) -> None:
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    spend(team, Decimal(spent))
    services.budget_set(team=team, monthly_limit=Decimal(limit), by=None)


def bursts_of(job: Job) -> int:
    return Node.objects.filter(burst_job=job).count()


def reason(job: Job) -> str:
    job.refresh_from_db()
    return job.pending_reason


def test_a_burst_that_would_overshoot_the_budget_is_not_asked_for_and_says_why(team):
    """$30 spent of $100: 8 GPUs for an hour at $80 a node-hour would end at $110."""
    burst_pool(on_demand="80")
    spent_and_budgeted(team, spent=30, limit=100)
    job = cloud_job(team)

    scheduling_pass()

    assert bursts_of(job) == 0
    assert reason(job) == (
        "no cloud burst: 8 GPUs for 1 h on aws-test (p5.48xlarge, on-demand) could cost "
        "$80.00, and team alpha has $70.00 of its $100.00 budget left this month"
    )

    services.budget_set(team=team, monthly_limit=Decimal(120), by=None)
    scheduling_pass()
    assert bursts_of(job) == 1


def test_a_burst_that_fits_in_what_is_left_is_asked_for(team):
    burst_pool(on_demand="80")
    spent_and_budgeted(team, spent=30, limit=100)
    job = cloud_job(team, time_limit_s=1800)  # $40

    assert selectors.teams_out_of_budget() == frozenset()
    scheduling_pass()

    (node,) = Node.objects.filter(burst_job=job)
    assert node.capacity_type == "on_demand"


def test_a_max_cost_below_the_projection_lets_the_burst_through(team, other_team):
    """Both teams: $30 spent of $100, a job of 8 GPUs for an hour at $80 a node-hour. The
    job with max_cost_usd $60 is stopped there, so it can cost no more: it fits."""
    pool = test_cloud.cloud_pool()
    for each in (team, other_team):
        spent_and_budgeted(each, spent=30, limit=100)
    capped = cloud_job(team, max_cost_usd="60.00")
    uncapped = cloud_job(other_team)
    # Priced after submission (the price changed since): a job projected above its
    # max_cost_usd when it is submitted is refused then.
    cloud_price("80", since=timezone.now() - dt.timedelta(days=1))

    scheduling_pass()

    assert Node.objects.filter(burst_job=capped, pool=pool).count() == 1
    assert bursts_of(uncapped) == 0
    assert "could cost $80.00, and team beta has $70.00" in reason(uncapped)


def test_bursts_of_one_pass_add_up_against_the_budget(team):
    """Two $40 bursts, $70 left: the first in the queue goes, the second would overshoot."""
    burst_pool(on_demand="80")
    spent_and_budgeted(team, spent=30, limit=100)
    first = cloud_job(team, time_limit_s=1800)
    second = cloud_job(team, time_limit_s=1800)

    scheduling_pass()

    assert (bursts_of(first), bursts_of(second)) == (1, 0)
    assert "could cost $40.00, and team alpha has $30.00 of its $100.00" in reason(second)


def test_a_spot_burst_is_priced_at_the_spot_price(team, other_team):
    """On-demand $80 a node-hour, spot $40: the same hour fits on spot, not on-demand."""
    burst_pool(on_demand="80", spot="40")
    for each in (team, other_team):
        spent_and_budgeted(each, spent=30, limit=100)
    on_spot = cloud_job(team, spot=True)
    on_demand = cloud_job(other_team, spot=False)

    scheduling_pass()

    (node,) = Node.objects.filter(burst_job=on_spot)
    assert node.capacity_type == "spot"
    assert bursts_of(on_demand) == 0
    assert "(p5.48xlarge, on-demand) could cost $80.00" in reason(on_demand)


def test_a_burst_with_no_price_is_refused_to_a_team_with_a_budget_only(team, other_team, caplog):
    """What an unpriced burst costs cannot be held against a budget (and metering would
    count it as free): refused, and said once in the log. A team without a budget is not
    asked; a job with max_cost_usd is bounded by it."""
    test_cloud.cloud_pool(region="us-west-2")  # the price book has no p5 price there
    spent_and_budgeted(team, spent=30, limit=100)
    unpriced = cloud_job(team)
    bounded = cloud_job(team, max_cost_usd="50.00")
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=64, by=None)
    unbudgeted = cloud_job(other_team)

    with caplog.at_level("WARNING", logger="apps.costs.selectors"):
        scheduling_pass()
        scheduling_pass()

    assert bursts_of(unpriced) == 0
    assert reason(unpriced) == (
        "no cloud burst: 8 GPUs for 1 h on aws-test (p5.48xlarge, on-demand) has no price "
        "in the price book, so its cost cannot be held against team alpha's budget"
    )
    assert (bursts_of(bounded), bursts_of(unbudgeted)) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if "no price" in r.getMessage()]
    assert warnings == [
        "no price for p5.48xlarge on_demand in pool aws-test: bursts of teams with a budget "
        "are refused"
    ]


def test_the_budget_boundary_is_kept_a_few_seconds_and_read_again_when_the_month_ends(team):
    """The answer is kept (a pass asks for every team); a change made elsewhere (another
    process: no forget) shows once the month it was read for is over."""
    from apps.costs.models import Budget

    spend(team, Decimal(30))
    services.budget_set(team=team, monthly_limit=Decimal(25), by=None)
    assert team.pk in selectors.teams_out_of_budget()
    Budget.objects.filter(team=team).update(monthly_limit=Decimal(1000))  # not forgotten here
    assert team.pk in selectors.teams_out_of_budget()  # kept
    kept = selectors._out_of_budget
    month_end = dt.datetime.fromtimestamp(kept["month_ends"], tz=selectors.time_zone())
    assert (month_end.day, month_end.hour, month_end.minute) == (1, 0, 0)
    assert month_end.date() == selectors.month_after(selectors.month_start())
    kept["month_ends"] = time.time() - 1  # as if the month ended a second ago
    assert team.pk not in selectors.teams_out_of_budget()


def test_a_spent_budget_refuses_new_jobs_only_when_it_says_so(
    fleet_pool, quota, team, researcher, api_for
):
    spend(team, Decimal(30))
    services.budget_set(team=team, monthly_limit=Decimal(10), by=None)
    client = api_for(researcher, scopes=("submit",))
    spec = command_spec(team, placement={"where": "owned"})

    allowed = client.post("/api/v1/jobs/", spec, format="json")
    services.budget_set(team=team, monthly_limit=Decimal(10), stop_submissions=True, by=None)
    refused = client.post("/api/v1/jobs/", {**spec, "name": "second"}, format="json")

    assert allowed.status_code == 201, allowed.content  # spent, but not set to refuse jobs
    assert refused.status_code == 400
    assert "budget" in refused.json()["error"]["details"]["team"][0]


def test_a_job_projected_above_its_max_cost_is_refused_with_the_projection(
    fleet_pool, quota, team, researcher, api_for
):
    owned_price(fleet_pool, since=timezone.now() - dt.timedelta(days=1))
    client = api_for(researcher, scopes=("submit",))

    refused = client.post(
        "/api/v1/jobs/", command_spec(team, max_cost_usd="5.00", time_limit_s=3600), format="json"
    )
    accepted = client.post(
        "/api/v1/jobs/", command_spec(team, max_cost_usd="20.00", time_limit_s=3600), format="json"
    )

    assert refused.status_code == 400
    problem = refused.json()["error"]["details"]["max_cost_usd"][0]
    # 8 GPUs × 1 h at 12.121644 a node-hour of 8 GPUs: $12.12.
    assert "$12.12" in problem and "h100-owned" in problem and "$5.00" in problem
    assert accepted.status_code == 201, accepted.content
    assert Job.objects.count() == 1


def test_a_running_job_that_reaches_its_max_cost_stops_with_a_checkpoint(
    fleet_pool, quota, team, researcher
):
    from workers.tasks.costs import meter_run

    owned_price(fleet_pool, since=timezone.now() - dt.timedelta(days=1))
    job, _ = jobs.job_submit(
        team=team,
        spec=command_spec(team, max_cost_usd="20.00", time_limit_s=3600),
        submitted_by=researcher,
    )
    scheduling_pass()
    for state in (JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING):
        job = jobs.job_transition(job=job, to=state, reason="test", by=None)

    under = meter_run(until=timezone.now() + dt.timedelta(minutes=30))
    over = meter_run(until=timezone.now() + dt.timedelta(hours=2))

    assert under["stopped"] == [] and over["stopped"] == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.STOPPING
    assert job.state_reason.startswith("cost limit of $20.00 reached")
    dispatch._finish_stopping(job)  # what the last run's stop report does
    job.refresh_from_db()
    assert job.state == JobState.FAILED and job.state_reason.startswith("cost limit")


def test_the_job_page_and_api_show_cost_so_far_and_the_projection(
    fleet_pool, quota, team, researcher, api_for, client
):
    owned_price(fleet_pool, since=timezone.now() - dt.timedelta(days=1))
    job, _ = jobs.job_submit(
        team=team, spec=command_spec(team, time_limit_s=7200), submitted_by=researcher
    )

    before = api_for(researcher).get(f"/api/v1/jobs/{job.pk}/").json()["cost"]
    client.force_login(researcher)
    pending = client.get(f"/jobs/{job.pk}/").content.decode()
    scheduling_pass()
    meter(Allocations(), until=timezone.now())  # nothing held yet: idle only
    from workers.tasks.costs import meter_run

    meter_run(until=timezone.now() + dt.timedelta(hours=1))
    after = api_for(researcher).get(f"/api/v1/jobs/{job.pk}/").json()["cost"]
    page = client.get(f"/jobs/{job.pk}/").content.decode()

    per_node_hour = Decimal("12.121644")
    assert Decimal(before["projected_low"]) == per_node_hour * 2  # 8 GPUs × 2 h
    assert before["cheapest_pool"] == "h100-owned" and Decimal(before["so_far"]) == 0
    assert Decimal(after["so_far"]) == pytest.approx(per_node_hour, rel=Decimal("0.01"))
    assert Decimal(after["per_hour"]) == per_node_hour
    # So far, plus the rate over what is left of its 2 h limit (the clock has not moved).
    expected = Decimal(after["so_far"]) + per_node_hour * 2
    assert Decimal(after["projected"]) == pytest.approx(expected, rel=Decimal("0.01"))
    assert 'id="job-cost"' in page and "Cost so far" in page
    # $0 until metered is explained; once metered, when, and how often.
    assert "cost is metered every 5 minutes, so it shows $0 until the first metering run" in (
        pending
    )
    assert re.search(r"metered up to [A-Z][a-z]{2} \d+ \d\d:\d\d; cost is metered every 5", page)


def test_only_finance_and_the_teams_admins_set_its_budget(team, other_team, user_for_role):
    admin = factories.make_member(team=team, role=TeamRole.ADMIN)
    services.budget_set(team=team, monthly_limit=Decimal(5), by=admin)
    with pytest.raises(Exception, match="Only finance and admins"):
        services.budget_set(team=other_team, monthly_limit=Decimal(5), by=admin)
    with pytest.raises(Exception, match="Only finance and admins"):
        services.budget_set(team=team, monthly_limit=Decimal(5), by=user_for_role("ops"))
