"""Costs that agree with themselves: for any filter, grouping and idle mode, the Costs page's
tiles, its chart, its table, the CSVs and the API give the same total, and it is the total
worked out by hand from the ledger. Also what the forecast says it is based on, the page's
live region, and the ledger CSV's names."""

import datetime as dt
import re
from decimal import Decimal
from fractions import Fraction

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.costs import selectors, services
from apps.costs.models import UsageEntry
from apps.costs.money import NANOS, cents
from tests import factories
from tests.apps.costs import conftest as costs
from tests.apps.costs.test_pages import RANGE, csv_rows

pytestmark = pytest.mark.django_db

GROUPS = ["team", "pool", "capacity_type", "instance_type"]


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


CENT = Decimal("0.01")


def decimal(value: Fraction) -> Decimal:
    return Decimal(value.numerator) / Decimal(value.denominator)


def dollars(text: str) -> Decimal:
    """`$1,234.56` (or `−$3.00`) as a number."""
    sign = -1 if text.strip().startswith("−") else 1
    return sign * Decimal(re.sub(r"[^0-9.]", "", text))


def shown(html: str, element_id: str) -> Decimal | None:
    """The first amount in the element with this id, as the page shows it (to the cent)."""
    found = re.search(
        rf'id="{element_id}"[^>]*>(?:[^$<−]|<[^>]+>)*?(−?\$[0-9,]+\.[0-9]{{2}})', html
    )
    return dollars(found.group(1)) if found else None


def figures(client: Client, query: str) -> dict:
    """Every total the page, its CSVs and the API give for one query."""
    page = client.get(f"/costs/?{query}")
    assert page.status_code == 200, page.content[:500]
    html = page.content.decode()
    by_group = csv_rows(client.get(f"/costs/spend.csv?{query}"))
    by_day = csv_rows(client.get(f"/costs/spend-by-day.csv?{query}"))
    api = client.get(f"/api/v1/spend/?{query}")
    assert api.status_code == 200, api.content[:500]
    return {
        "tile": shown(html, "total-spend"),
        "table": shown(html, "spend-total"),
        "chart": shown(html, "chart-total"),
        "spend.csv": sum((Decimal(row[3]) for row in by_group[1:]), Decimal(0)),
        "spend-by-day.csv": sum((Decimal(row[2]) for row in by_day[1:]), Decimal(0)),
        "api": Decimal(api.json()["total"]),
        "api rows": sum((Decimal(row["total"]) for row in api.json()["rows"]), Decimal(0)),
    }


def assert_agree(got: dict, expected) -> None:
    """To the nano-unit (well, a millionth) where amounts are exact, to the cent on the page."""
    expected = decimal(expected)
    for name in ("spend.csv", "spend-by-day.csv", "api", "api rows"):
        assert abs(got[name] - expected) < Decimal("0.000001"), (name, got, expected)
    rounded = cents(expected)
    for name in ("tile", "table", "chart"):
        if got[name] is None:  # no rows, no bars: nothing was spent
            assert rounded == 0, (name, got, expected)
        else:
            assert abs(got[name] - rounded) <= CENT, (name, got, expected)
    assert got["tile"] == (got["table"] if got["table"] is not None else got["tile"])


# --- the reproduction ---------------------------------------------------------------------------


def test_a_team_filter_with_idle_spread_gives_one_total_everywhere(finance_user, metered, team):
    """Issue 33: `?group_by=team&team_id=1&idle=spread` showed a Total tile of $17.19 while
    its chart showed about $2; by capacity type, $2.12 and no idle; the CSVs disagreed."""
    client = browser(finance_user)
    alpha_jobs = Fraction(Decimal("12.121644")) * 24  # 8 of the owned node's 8 GPUs, a day
    beta_jobs = Fraction(Decimal("55.04")) * 24 / 2  # 4 of the cloud node's 8, a day
    fleet = Fraction(Decimal("12.121644")) * 48 + Fraction(Decimal("55.04")) * 48
    idle = fleet - alpha_jobs - beta_jobs
    alpha = alpha_jobs + idle * alpha_jobs / (alpha_jobs + beta_jobs)

    for group_by in GROUPS:
        got = figures(client, f"{RANGE}&group_by={group_by}&team_id={team.pk}&idle=spread")
        assert_agree(got, alpha)
        assert got["tile"] == got["chart"] == got["table"] == cents(decimal(alpha))

    # By capacity type too, alpha carries its share of idle (it showed $0).
    page = client.get(f"/costs/?{RANGE}&group_by=capacity_type&team_id={team.pk}&idle=spread")
    share = idle * alpha_jobs / (alpha_jobs + beta_jobs)
    assert abs(shown(page.content.decode(), "idle-spend") - cents(decimal(share))) <= CENT


# --- the property -------------------------------------------------------------------------------

FIRST = dt.date(2026, 10, 20)  # the ledger runs over the whole of November and either side
LEDGER_DAYS = 45


@pytest.fixture
def world(db):
    """Three teams, two pools, an instance type; finance, and a member of the first team."""
    teams = [factories.make_team(slug=slug) for slug in ("alpha", "beta", "gamma")]
    pools = [factories.make_owned_pool(slug="prop-owned"), costs.cloud_pool("prop-cloud")]
    kind = factories.instance_type("p5.48xlarge")
    return {
        "teams": teams,
        "pools": pools,
        "instance_type": kind,
        "finance": browser(factories.make_org_user(role="finance")),
        "member": browser(factories.make_member(team=teams[0])),
    }


# in nano-units; now and then a correction that takes away
AMOUNTS = st.one_of(st.integers(1, 400 * NANOS), st.integers(-20 * NANOS, -1))
# A node's day: its idle, and what some teams' jobs used of it.
node_days = st.fixed_dictionaries(
    {
        "day": st.integers(0, LEDGER_DAYS - 1),
        "pool": st.integers(0, 1),
        "capacity": st.sampled_from(["owned", "on_demand", "spot"]),
        "typed": st.booleans(),
        "idle": st.one_of(st.just(0), AMOUNTS),
        "used": st.lists(st.tuples(st.integers(1, 3), AMOUNTS), max_size=3),
    }
)
entries = st.lists(node_days, min_size=1, max_size=12).map(
    lambda days: [
        {
            **{k: v for k, v in d.items() if k not in ("idle", "used")},
            "team": team,
            "amount": amount,
        }
        for d in days
        for team, amount in [(0, d["idle"]), *d["used"]]
        if amount
    ]
)
filters = st.fixed_dictionaries(
    {
        # mostly a range over much of the ledger (a whole month or two), now and then a day
        "since": st.one_of(st.integers(-5, 12), st.integers(-5, LEDGER_DAYS + 5)),
        "days": st.one_of(st.integers(20, 60), st.integers(0, 10)),
        "team": st.one_of(st.none(), st.integers(1, 3)),
        "pool": st.one_of(st.none(), st.integers(0, 1)),
        "capacity": st.one_of(st.none(), st.sampled_from(["owned", "on_demand", "spot"])),
        "typed": st.one_of(st.none(), st.just(True)),
        "group_by": st.sampled_from(GROUPS),
        "idle": st.sampled_from(["separate", "spread"]),
        "viewer": st.sampled_from(["finance", "member"]),
    }
)


def by_hand(ledger: list[dict], f: dict, *, since: dt.date, until: dt.date) -> Fraction:
    """The total, from the ledger rows alone: what the filters keep, what the viewer may see,
    and idle spread over every team's use under the same filters."""

    def kept(e) -> bool:
        return (
            since <= FIRST + dt.timedelta(days=e["day"]) <= until
            and (f["pool"] is None or e["pool"] == f["pool"])
            and (f["capacity"] is None or e["capacity"] == f["capacity"])
            and (f["typed"] is None or e["typed"])
        )

    def seen(e) -> bool:
        teams = {1, 2, 3, 0} if f["viewer"] == "finance" else {1}
        if f["team"] is not None:
            teams &= {f["team"]}
        return e["team"] in teams

    rows = [e for e in ledger if kept(e)]
    scope = [e for e in rows if seen(e)]
    total = Fraction(sum(e["amount"] for e in scope), NANOS)
    if f["idle"] == "separate":
        return total
    used = Fraction(sum(e["amount"] for e in rows if e["team"]), NANOS)
    if not used:
        return total  # nobody used anything: idle stays idle
    idle = Fraction(sum(e["amount"] for e in rows if not e["team"]), NANOS)
    ours = Fraction(sum(e["amount"] for e in scope if e["team"]), NANOS)
    return ours + idle * ours / used


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ledger=entries, f=filters)
def test_every_view_gives_the_same_total_for_any_filter_grouping_and_idle_mode(world, ledger, f):
    teams, pools = world["teams"], world["pools"]
    since = FIRST + dt.timedelta(days=f["since"])
    until = since + dt.timedelta(days=f["days"])
    with transaction.atomic():
        now = timezone.now()
        UsageEntry.objects.bulk_create(
            UsageEntry(
                node_id=1,
                pool_id=pools[e["pool"]].pk,
                instance_type_id=world["instance_type"].pk if e["typed"] else None,
                team_id=teams[e["team"] - 1].pk if e["team"] else None,
                kind="job" if e["team"] else "idle",
                capacity_type=e["capacity"],
                gpus=8,
                node_gpus=8,
                start=dt.datetime.combine(FIRST + dt.timedelta(days=e["day"]), dt.time(1), dt.UTC),
                end=dt.datetime.combine(FIRST + dt.timedelta(days=e["day"]), dt.time(2), dt.UTC),
                day=FIRST + dt.timedelta(days=e["day"]),
                rate_per_hour=Decimal(1),
                amount=Decimal(e["amount"]) / NANOS,
                price_ref="test",
                recorded_at=now,
            )
            for e in ledger
        )
        services.rollups_rebuild()
        query = [f"since={since}", f"until={until}", f"group_by={f['group_by']}"]
        query.append(f"idle={f['idle']}")
        if f["team"] is not None:
            query.append(f"team_id={teams[f['team'] - 1].pk}")
        if f["pool"] is not None:
            query.append(f"pool_id={pools[f['pool']].pk}")
        if f["capacity"] is not None:
            query.append(f"capacity_type={f['capacity']}")
        if f["typed"]:
            query.append(f"instance_type_id={world['instance_type'].pk}")
        if f["viewer"] == "member" and f["team"] not in (None, 1):
            # another team's spend is not found for a member: leave the team out
            f = {**f, "team": None}
            query = [q for q in query if not q.startswith("team_id=")]

        got = figures(world[f["viewer"]], "&".join(query))

        assert_agree(got, by_hand(ledger, f, since=since, until=until))
        transaction.set_rollback(True)


# --- what the forecast is based on ------------------------------------------------------------


def _spend(pool, team, day: dt.date, amount: str) -> None:
    UsageEntry.objects.create(
        node_id=1,
        pool_id=pool.pk,
        team_id=team.pk,
        kind="job",
        capacity_type="owned",
        gpus=8,
        node_gpus=8,
        start=dt.datetime.combine(day, dt.time(1), dt.UTC),
        end=dt.datetime.combine(day, dt.time(2), dt.UTC),
        day=day,
        rate_per_hour=Decimal(1),
        amount=Decimal(amount),
        price_ref="test",
        recorded_at=timezone.now(),
    )


def test_the_forecast_says_it_is_the_recent_days_average_times_the_days_left(finance_user, team):
    pool = factories.make_owned_pool(slug="forecast")
    today = selectors.local_today()
    for back in range(1, 8):  # $70 over the last 7 whole days: $10 a day
        _spend(pool, team, today - dt.timedelta(days=back), "10")
    _spend(pool, team, today, "3")
    services.rollups_rebuild()

    html = browser(finance_user).get("/costs/").content.decode()
    forecast = selectors.spend_forecast(
        selectors.RollUps(
            daily=selectors.daily_spend_visible_to(user=finance_user),
            monthly=selectors.monthly_spend_visible_to(user=finance_user),
        ),
        month=selectors.month_start(),
    )

    assert forecast.per_day == Decimal(10)
    basis = re.search(r'id="forecast-basis">([^<]*)', html).group(1)
    assert "$10.00 a day (the average of the last 7 whole days" in basis
    assert f"{forecast.spent:.2f}" in basis.replace(",", "")
    assert shown(html, "forecast") == cents(forecast.amount)


def test_on_the_first_of_a_month_with_nothing_spent_before_it_says_why_it_is_spend_so_far(team):
    first = dt.date(2026, 12, 1)
    _spend(factories.make_owned_pool(slug="forecast"), team, first, "4.50")
    services.rollups_rebuild()
    now = dt.datetime(2026, 12, 1, 9, tzinfo=dt.UTC)
    rollups = selectors.RollUps(
        daily=selectors.daily_spend_visible_to(user=factories.make_org_user(role="finance")),
    )

    forecast = selectors.spend_forecast(rollups, month=first, now=now)

    assert forecast.per_day == 0 and forecast.amount == forecast.spent == Decimal("4.5")
    assert forecast.window.since == dt.date(2026, 11, 24)
    assert forecast.window.until == dt.date(2026, 11, 30)
    from django.template.loader import render_to_string

    html = render_to_string(
        "costs/_figures.html",
        {"report": _ReportLike(forecast), "rows": [], "live": False},
    )
    assert "Nothing was spent in the last 7 whole days (Nov 24 – Nov 30)" in html
    assert "today is not a whole day yet, so the forecast is the $4.50 spent so far" in html


class _ReportLike:
    """Enough of a report to render the tiles around one forecast."""

    def __init__(self, forecast):
        self.forecast = forecast
        self.month = forecast.window.month
        self.idle_mode = "separate"
        self.since = self.until = forecast.window.month
        self.group_by = "team"
        self.spend = selectors.SpendReport(
            since=self.since,
            until=self.until,
            group_by="team",
            idle_mode="separate",
            rows=[],
            total=Decimal(0),
            jobs=Decimal(0),
            idle=Decimal(0),
            savings=Decimal(0),
        )


# --- the live region and its queries ------------------------------------------------------------


PAGE_QUERIES = 37  # the whole page, the worst case: idle spread, months from the monthly roll-up
FIGURES_QUERIES = 18  # its live region alone (session, user and roles included)


@pytest.mark.parametrize("viewer", ["finance_user", "researcher"])
@pytest.mark.parametrize("group_by", GROUPS)
@pytest.mark.parametrize("idle", ["separate", "spread"])
def test_the_page_and_its_figures_read_a_bounded_number_of_queries(
    viewer, group_by, idle, metered, team, request, django_assert_max_num_queries
):
    client = browser(request.getfixturevalue(viewer))
    for query in [
        f"group_by={group_by}&idle={idle}",
        f"{RANGE}&group_by={group_by}&idle={idle}&team_id={team.pk}",
        f"{RANGE}&group_by={group_by}&idle={idle}&pool_id={metered['cloud'].pk}",
    ]:
        with django_assert_max_num_queries(PAGE_QUERIES):
            assert client.get(f"/costs/?{query}").status_code == 200
        with django_assert_max_num_queries(FIGURES_QUERIES):
            assert client.get(f"/costs/figures/?{query}").status_code == 200


def test_the_figures_follow_new_spend_through_a_live_region(finance_user, team):
    client = browser(finance_user)
    query = f"group_by=team&team_id={team.pk}&idle=spread"
    page = client.get(f"/costs/?{query}").content.decode()
    assert re.search(r'<div id="costs-figures" data-live hx-get="/costs/figures/\?', page)
    assert 'hx-trigger="every 30s, live:resume"' in page
    assert "new spend is metered every 5 minutes" in page
    assert shown(page, "total-spend") == 0

    now = timezone.now()
    pool = costs.cloud_pool("aws-live")
    costs.cloud_price("10", since=now - dt.timedelta(days=3))
    node = costs.cloud_node(pool, launched=now - dt.timedelta(hours=2))
    costs.meter(costs.Allocations([(node.pk, 1, team.pk, 8, node.launched_at, None)]), until=now)
    fragment = client.get(f"/costs/figures/?{query}")
    html = fragment.content.decode()

    assert fragment.status_code == 200 and 'id="costs-figures"' in html
    assert "<html" not in html and "costs-filters" not in html  # the figures, not the page
    total = shown(html, "total-spend")
    assert total > 0 and total == shown(html, "chart-total") == shown(html, "spend-total")
    assert "Metered up to" in html


def test_a_range_in_the_past_is_not_asked_for_again(finance_user, metered):
    page = browser(finance_user).get(f"/costs/?{RANGE}").content.decode()
    assert (
        '<div id="costs-figures">' in page
        and "data-live" not in page.split("costs-figures")[1][:40]
    )


# --- the ledger CSV names what its ids are -------------------------------------------------------


def test_the_ledger_csv_has_names_beside_the_ids(finance_user, metered, team, other_team):
    rows = csv_rows(browser(finance_user).get(f"/costs/usage.csv?{RANGE}"))
    header, body = rows[0], rows[1:]

    for id_column, name in [
        ("node_id", "node"),
        ("pool_id", "pool"),
        ("instance_type_id", "instance_type"),
        ("team_id", "team"),
        ("job_id", "job"),
    ]:
        assert header[header.index(id_column) + 1] == name
    teams = {r[header.index("team_id")]: r[header.index("team")] for r in body}
    assert teams == {str(team.pk): "alpha", str(other_team.pk): "beta", "": ""}
    pools = {r[header.index("pool")] for r in body}
    assert pools == {"fra-h100", "aws-p5"}
    assert all(r[header.index("node")] for r in body)
    kinds = {r[header.index("instance_type")] for r in body if r[header.index("pool")] == "aws-p5"}
    assert kinds == {"p5.48xlarge"}


def test_names_in_the_ledger_csv_are_not_run_as_formulas_and_blank_once_gone(finance_user):
    team = factories.make_team(slug="delta")
    pool = costs.cloud_pool("aws-formula")
    node = costs.cloud_node(pool, launched=costs.at(0))
    costs.cloud_price("8", since=costs.at(-1))
    costs.meter(
        costs.Allocations([(node.pk, 999_999, team.pk, 8, costs.at(0), costs.at(1))]),
        until=costs.at(1),
    )
    Team = type(team)
    Team.objects.filter(pk=team.pk).update(slug="=HYPERLINK(1)")  # past the slug's validator

    rows = csv_rows(browser(finance_user).get(f"/costs/usage.csv?{RANGE}&team_id={team.pk}"))
    header, body = rows[0], rows[1:]

    assert body and {r[header.index("team")] for r in body} == {"'=HYPERLINK(1)"}
    assert {r[header.index("job_id")] for r in body} == {"999999"}
    assert {r[header.index("job")] for r in body} == {""}  # no such job (any more)


# --- the budget form --------------------------------------------------------------------------


def test_the_budget_form_is_laid_out_like_the_other_forms(team_admin):
    html = browser(team_admin).get("/costs/").content.decode()
    form = html[html.index('id="budget-form"') :]
    form = form[: form.index("</form>")]

    assert "<p>" not in form  # not Django's as_p
    assert '<div class="field">' in form and '<label for="id_monthly_limit">' in form
    assert 'class="field field-check"' in form  # the checkbox beside its label
