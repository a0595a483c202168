"""The Costs report as one request asks for it: the page, the API and the CSV exports all
build it here from the same query parameters, through the same FilterSets."""

import datetime as dt
from dataclasses import dataclass

from django import forms
from django.conf import settings
from django.http import Http404, QueryDict

from apps.accounts.selectors import roles_of
from apps.costs import selectors
from apps.costs.filtersets import (
    DailySpendFilterSet,
    JobDailySpendFilterSet,
    MonthlySpendFilterSet,
)
from apps.costs.models import DailySpend, MonthlySpend
from controlplane.errors import ApplicationError

GROUP_CHOICES = [
    ("team", "Team"),
    ("pool", "Pool"),
    ("capacity_type", "Capacity type"),
    ("instance_type", "Instance type"),
]
IDLE_CHOICES = [("separate", "Idle as its own line"), ("spread", "Idle spread over teams by use")]
MAX_DAYS = 400
CHART_GROUPS = 6  # the chart's largest groups; the rest are drawn as one "other"


class ReportOptions(forms.Form):
    group_by = forms.ChoiceField(choices=GROUP_CHOICES, required=False)
    idle = forms.ChoiceField(choices=IDLE_CHOICES, required=False)
    top = forms.IntegerField(min_value=1, max_value=500, required=False)


@dataclass
class Report:
    since: dt.date
    until: dt.date
    group_by: str
    idle_mode: str
    spend: selectors.SpendReport
    top_jobs: list
    budgets: list
    forecast: selectors.SpendForecast | None  # this month's, same filters and idle mode
    forecast_total: object  # its amount
    month: dt.date
    filters: DailySpendFilterSet
    query: QueryDict


def _with_defaults(query: QueryDict) -> QueryDict:
    """The month so far when no range is given."""
    data = query.copy()
    today = selectors.local_today()
    if not data.get("since"):
        data["since"] = (today.replace(day=1)).isoformat()
    if not data.get("until"):
        data["until"] = today.isoformat()
    return data


def _invalid(errors) -> ApplicationError:
    details = {key: [str(m) for m in messages] for key, messages in errors.items()}
    return ApplicationError(f"Invalid input: {', '.join(details)}.", details=details)


def filtered_spend(*, user, query: QueryDict):
    """(FilterSet, since, until, data) for the roll-ups this user may see; a team of
    someone else's is answered as if it did not exist."""
    data = _with_defaults(query)
    spend = DailySpendFilterSet(data, queryset=selectors.daily_spend_visible_to(user=user))
    if not spend.is_valid():
        raise _invalid(spend.errors)
    since, until = spend.form.cleaned_data["since"], spend.form.cleaned_data["until"]
    if until < since:
        raise _invalid({"until": ["Must be on or after since."]})
    if since.year < 2000 or until.year > 2999:
        raise _invalid({"since": ["Between the years 2000 and 2999."]})
    if (until - since).days > MAX_DAYS:
        raise _invalid({"since": [f"At most {MAX_DAYS} days at a time."]})
    team_id = spend.form.cleaned_data.get("team_id")
    roles = roles_of(user)
    if team_id and not roles.sees_every_team and team_id not in roles.team_ids:
        raise Http404("No such team.")
    return spend, since, until, data


def _rollups(*, user, data: QueryDict) -> tuple[selectors.RollUps, selectors.RollUps]:
    """The roll-ups under the filters but the days (the report reads its range, the
    forecast its month): those the user may see, and every team's (whose use idle is
    spread over, whoever is looking)."""
    undated = data.copy()
    for key in ("since", "until"):
        undated.pop(key, None)
    seen = selectors.RollUps(
        daily=DailySpendFilterSet(undated, queryset=selectors.daily_spend_visible_to(user=user)).qs,
        monthly=MonthlySpendFilterSet(
            undated, queryset=selectors.monthly_spend_visible_to(user=user)
        ).qs,
    )
    if roles_of(user).sees_every_team and not undated.get("team_id"):
        return seen, seen  # the same roll-ups: the selectors then read them once
    everyone = undated.copy()
    everyone.pop("team_id", None)
    return (
        seen,
        selectors.RollUps(
            daily=DailySpendFilterSet(everyone, queryset=DailySpend.objects.all()).qs,
            monthly=MonthlySpendFilterSet(everyone, queryset=MonthlySpend.objects.all()).qs,
        ),
    )


def build(
    *,
    user,
    query: QueryDict,
    top: int = 20,
    series: bool = True,
    jobs: bool = True,
    budgets: bool = True,
    forecast: bool = True,
) -> Report:
    """The report, or the parts of it asked for (the API's endpoints each want one)."""
    spend, since, until, data = filtered_spend(user=user, query=query)
    options = ReportOptions(data)
    if not options.is_valid():
        raise _invalid(options.errors)
    group_by = options.cleaned_data.get("group_by") or "team"
    idle_mode = options.cleaned_data.get("idle") or settings.COSTS_IDLE_COST
    seen, everyone = _rollups(user=user, data=data)
    report = selectors.spend_report(
        seen,
        since=since,
        until=until,
        group_by=group_by,
        idle_mode=idle_mode,
        spread_base=everyone,
        series_groups=CHART_GROUPS if series else 0,
    )
    month = selectors.month_start()
    projected = (
        selectors.spend_forecast(seen, month=month, idle_mode=idle_mode, spread_base=everyone)
        if forecast
        else None
    )
    job_spend = JobDailySpendFilterSet(
        {k: data[k] for k in ("since", "until", "team_id") if data.get(k)},
        queryset=selectors.job_spend_visible_to(user=user),
    )
    roles = roles_of(user)
    team_ids = None if roles.sees_every_team else roles.team_ids
    if spend.form.cleaned_data.get("team_id"):
        team_ids = {spend.form.cleaned_data["team_id"]}
    return Report(
        since=since,
        until=until,
        group_by=group_by,
        idle_mode=idle_mode,
        spend=report,
        top_jobs=selectors.top_jobs(job_spend.qs, limit=options.cleaned_data.get("top") or top)
        if jobs
        else [],
        budgets=selectors.budget_states(month=month, team_ids=team_ids) if budgets else [],
        forecast=projected,
        forecast_total=projected.amount if projected else None,
        month=month,
        filters=spend,
        query=data,
    )
