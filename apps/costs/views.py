"""The Costs page: spend by day and group, top jobs, budgets, the price book, and a CSV
export of every table with the page's filters."""

import functools
from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.accounts.selectors import roles_of, teams_budgeted_by, teams_visible_to
from apps.costs import reports, selectors, services
from apps.costs.filtersets import UsageEntryFilterSet
from apps.costs.forms import BudgetForm, CloudPriceForm, OwnedPriceForm, PoolDiscountForm
from apps.costs.money import apportion_cents, cents, money_text, nanos_text, to_nanos
from apps.fleet import selectors as fleet
from apps.fleet.models.nodes import CapacityType
from controlplane import charts
from controlplane.errors import ApplicationError
from controlplane.exports import csv_stream, csv_stream_text, spreadsheet_safe
from controlplane.selects import options_html


def _chart(report: reports.Report):
    group = dict(reports.GROUP_CHOICES)[report.group_by].lower()
    return charts.stacked_bar_chart(
        report.spend.days,
        report.spend.series,
        title=f"Spend by day and {group}",
        y_format=lambda v: "$" + charts.compact_number(v),
        x_label=lambda day: f"{day:%b %-d}",
    )


# The table by group shows the largest groups; the rest are one row (each in the CSV).
TABLE_ROWS = 50


def _figures(request, report: reports.Report) -> dict:
    """What the live part of the page shows (tiles, chart, table by group), from the one
    report: the rows, the chart's days and the tiles are the same spend."""
    spend = report.spend
    row_cents = apportion_cents([row.total for row in spend.rows])
    jobs_cents, idle_cents = apportion_cents([spend.jobs, spend.idle])
    chart_total = sum(
        (sum(days.values(), Decimal(0)) for days in spend.series.values()), Decimal(0)
    )
    rows = list(zip(spend.rows, row_cents, strict=True))
    rest = rows[TABLE_ROWS:]
    return {
        "report": report,
        "rows": rows[:TABLE_ROWS],
        "rest": {
            "count": len(rest),
            "jobs": sum((row.jobs for row, _ in rest), Decimal(0)),
            "idle": sum((row.idle for row, _ in rest), Decimal(0)),
            "rounded": sum((rounded for _, rounded in rest), Decimal(0)),
            "total": sum((row.total for row, _ in rest), Decimal(0)),
            "gpu_hours": sum((row.gpu_hours for row, _ in rest), Decimal(0)),
            "savings": sum((row.savings for row, _ in rest), Decimal(0)),
        }
        if rest
        else None,
        "total_cents": cents(spend.total),
        "jobs_cents": jobs_cents,
        "idle_cents": idle_cents,
        "idle_share": (spend.idle * 100 / spend.total) if spend.total else Decimal(0),
        "chart": _chart(report),
        "chart_total_cents": cents(chart_total),
        "sees_idle": roles_of(request.user).sees_every_team,
        "metered_until": selectors.metered_until(),
        # Spend changes while the range reaches today; a range in the past stays as it is.
        "live": report.until >= selectors.local_today(),
        "querystring": report.query.urlencode(),
    }


@login_required
def overview(request):
    return _overview(request)


def _overview(request, *, webhook_key: str | None = None, status: int = 200):
    try:
        report = reports.build(user=request.user, query=request.GET)
    except ApplicationError as exc:
        for field, problems in exc.details.items():
            for problem in problems:
                messages.error(request, f"{field}: {problem}")
        return redirect("costs:overview")
    roles = roles_of(request.user)
    budget_form, budget_pick_team = _budget_form(request.user, report.query.get("team_id"))
    finance = roles.superuser or roles.finance
    return render(
        request,
        "costs/overview.html",
        {
            **_figures(request, report),
            "filters": report.query,
            "group_choices": reports.GROUP_CHOICES,
            "idle_choices": reports.IDLE_CHOICES,
            "team_options": options_html(
                teams_visible_to(user=request.user).order_by("slug").values_list("pk", "slug"),
                report.query.get("team_id"),
            ),
            "pools": fleet.pools_of_kind(),
            "instance_types": fleet.instance_types_for_listing(),
            "capacity_types": CapacityType.choices,
            "owned_prices": selectors.owned_prices(),
            "cloud_prices": [
                (price, price.per_hour / price.instance_type.gpu_count)
                for price in selectors.cloud_prices()
            ],
            "time_zone": settings.COSTS_TIME_ZONE,
            "discounts": selectors.pool_discounts(),
            "spot_prices": selectors.spot_prices_latest(),
            "unpriced": selectors.unpriced_pools() if roles.sees_every_team else [],
            "can_edit_prices": finance,
            "budget_form": budget_form,
            "budget_pick_team": budget_pick_team,
            "owned_form": OwnedPriceForm() if finance else None,
            "cloud_form": CloudPriceForm() if finance else None,
            "discount_form": PoolDiscountForm() if finance else None,
            "webhook_key": webhook_key,
        },
        status=status,
    )


# Past this many teams the budget form asks for a team chosen in the filters, rather than
# offering a list of them all (finance sees every team: 1,000 options render slowly).
BUDGET_FORM_TEAMS = 50


def _budget_form(user, team_id: str | None) -> tuple[BudgetForm | None, bool]:
    """The budget form for the teams the user budgets (the filtered team only, where one
    is chosen), and whether it waits for a team to be chosen first."""
    teams = teams_budgeted_by(user=user)
    if team_id and team_id.isdigit():
        teams = teams.filter(pk=int(team_id))
    count = teams.count()
    if not count:
        return None, False
    if count > BUDGET_FORM_TEAMS:
        return None, True
    chosen = int(team_id) if team_id and team_id.isdigit() else None
    return BudgetForm(teams=teams, initial={"team": chosen}), False


def _refusals_as_400(view):
    """A bad filter (an impossible range, an unknown group) is a 400 with the reason."""

    @functools.wraps(view)
    def wrapped(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except ApplicationError as exc:
            problems = "; ".join(
                f"{field}: {' '.join(map(str, messages))}"
                for field, messages in exc.details.items()
            )
            return HttpResponseBadRequest(
                f"{exc.message} {problems}".strip(), content_type="text/plain; charset=utf-8"
            )

    return wrapped


@login_required
@_refusals_as_400
def figures(request):
    """The live part of the page alone (tiles, chart, table by group), asked for again
    while the page is open, with the page's filters."""
    report = reports.build(user=request.user, query=request.GET, jobs=False, budgets=False)
    return render(request, "costs/_figures.html", _figures(request, report))


def _form_errors(request, form) -> None:
    for field, problems in form.errors.items():
        messages.error(request, f"{field}: {' '.join(problems)}")


@login_required
@require_POST
def budget_set(request):
    form = BudgetForm(request.POST, teams=teams_budgeted_by(user=request.user))
    if not form.is_valid():
        _form_errors(request, form)
        return redirect("costs:overview")
    try:
        budget, key = services.budget_set(by=request.user, **form.cleaned_data)
    except ApplicationError as exc:
        messages.error(request, exc.message)
        return redirect("costs:overview")
    messages.success(
        request, f"Budget of {budget.team.slug} set to {money_text(budget.monthly_limit)} a month."
    )
    if not key:
        return redirect("costs:overview")
    # The new webhook's key is in this answer only: never in the messages, whose storage
    # is a cookie (signed, not encrypted), nor in the session.
    response = _overview(request, webhook_key=key, status=201)
    response["Cache-Control"] = "no-store"
    return response


PRICE_FORMS = {
    "owned": (OwnedPriceForm, services.owned_price_create),
    "cloud": (CloudPriceForm, services.cloud_price_create),
    "discount": (PoolDiscountForm, services.pool_discount_create),
}


@login_required
@require_POST
def price_add(request, kind: str):
    if kind not in PRICE_FORMS:
        raise Http404("No such price.")
    form_class, create = PRICE_FORMS[kind]
    form = form_class(request.POST)
    if not form.is_valid():
        _form_errors(request, form)
        return redirect("costs:overview")
    try:
        create(by=request.user, **form.cleaned_data)
    except ApplicationError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, "Added to the price book; what was metered since is corrected.")
    return redirect("costs:overview")


# --- CSV: every table of the page, with its filters -----------------------------------------


def _money(value) -> str:
    return nanos_text(to_nanos(value))


@login_required
@_refusals_as_400
def spend_csv(request):
    report = reports.build(
        user=request.user,
        query=request.GET,
        series=False,
        jobs=False,
        budgets=False,
        forecast=False,
    )
    header = [report.group_by, "jobs", "idle", "total", "gpu_hours", "spot_savings"]
    rows = (
        [
            spreadsheet_safe(row.label),
            _money(row.jobs),
            _money(row.idle),
            _money(row.total),
            f"{row.gpu_hours:.3f}",
            _money(row.savings),
        ]
        for row in report.spend.rows
    )
    return csv_stream("spend.csv", header, rows)


@login_required
@_refusals_as_400
def daily_csv(request):
    report = reports.build(
        user=request.user, query=request.GET, jobs=False, budgets=False, forecast=False
    )
    rows = (
        [day.isoformat(), spreadsheet_safe(label), _money(amounts[day])]
        for label, amounts in sorted(report.spend.series.items())
        for day in sorted(amounts)
    )
    return csv_stream("spend-by-day.csv", ["day", report.group_by, "amount"], rows)


@login_required
@_refusals_as_400
def top_jobs_csv(request):
    report = reports.build(
        user=request.user, query=request.GET, top=500, series=False, forecast=False
    )
    rows = (
        [j.job_id, spreadsheet_safe(j.name), j.team, _money(j.amount), f"{j.gpu_hours:.3f}"]
        for j in report.top_jobs
    )
    return csv_stream("top-jobs.csv", ["job", "name", "team", "amount", "gpu_hours"], rows)


@login_required
@_refusals_as_400
def budgets_csv(request):
    report = reports.build(
        user=request.user, query=request.GET, series=False, jobs=False, forecast=False
    )
    rows = (
        [
            state.team,
            state.month.isoformat(),
            f"{state.monthly_limit:f}",
            _money(state.spent),
            f"{state.percent:.1f}",
            "" if state.forecast is None else _money(state.forecast),
            state.level,
            "yes" if state.exhausted else "no",
        ]
        for state in report.budgets
    )
    header = [
        "team",
        "month",
        "monthly_limit",
        "spent",
        "percent",
        "forecast",
        "level",
        "bursting_stopped",
    ]
    return csv_stream("budgets.csv", header, rows)


@login_required
@_refusals_as_400
def usage_csv(request):
    """The ledger itself, row by row, streamed (same filters as the page)."""
    _, since, until, data = reports.filtered_spend(user=request.user, query=request.GET)
    entries = UsageEntryFilterSet(data, queryset=selectors.usage_visible_to(user=request.user))
    header = ",".join(selectors.USAGE_CSV_COLUMNS) + "\r\n"

    def chunks():
        yield header
        yield from selectors.usage_csv_chunks(entries.qs)

    return csv_stream_text(f"usage-{since}-{until}.csv", chunks())


@login_required
def prices_csv(request):
    rows = []
    for view in selectors.owned_prices():
        price = view.price
        rows.append(
            [
                "owned",
                price.pool.slug,
                "",
                "",
                price.effective_from.isoformat(),
                f"{view.rate.per_hour:f}",
                f"{view.per_gpu_hour:.6f}",
                spreadsheet_safe(
                    f"{price.purchase_price} over {price.depreciation_months} months + "
                    f"{view.rate.power_w} W × PUE {price.pue} × {price.electricity_per_kwh}/kWh + "
                    f"{price.overhead_per_month}/month"
                ),
                spreadsheet_safe(price.source),
            ]
        )
    for price in selectors.cloud_prices():
        rows.append(
            [
                "on_demand",
                "",
                price.instance_type.name,
                price.region,
                price.effective_from.isoformat(),
                f"{price.per_hour:f}",
                f"{price.per_hour / price.instance_type.gpu_count:.6f}",
                "list price",
                spreadsheet_safe(price.source),
            ]
        )
    for discount in selectors.pool_discounts():
        rows.append(
            [
                "discount",
                discount.pool.slug,
                "",
                discount.pool.region,
                discount.effective_from.isoformat(),
                "",
                "",
                f"{discount.percent}% off on-demand",
                spreadsheet_safe(discount.source),
            ]
        )
    for spot in selectors.spot_prices_latest():
        rows.append(
            [
                "spot",
                "",
                spot.instance_type.name,
                spot.availability_zone,
                spot.effective_at.isoformat(),
                f"{spot.per_hour:f}",
                f"{spot.per_hour / spot.instance_type.gpu_count:.6f}",
                "describe_spot_price_history",
                "",
            ]
        )
    header = [
        "kind",
        "pool",
        "instance_type",
        "region_or_zone",
        "effective_from",
        "per_node_hour",
        "per_gpu_hour",
        "formula",
        "source",
    ]
    return csv_stream("prices.csv", header, rows)
