"""Finance opens the Costs page in headless Chromium: the chart, the table, a filter, the
CSV link carrying the page's filters, and a budget set through the page's form."""

import re

import pytest
from playwright.sync_api import expect

from apps.costs.models import Budget
from tests.apps.costs.conftest import metered  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _budget_state_forgotten():
    """The budget boundary keeps its answer a few seconds in-process: not past this test."""
    from apps.costs.selectors import forget_budget_state

    forget_budget_state()
    yield
    forget_budget_state()


def test_finance_reads_spend_filters_it_and_sets_a_budget(
    page,
    browser_login,
    finance_user,
    metered,  # noqa: F811
    team,
):
    base = browser_login(page, finance_user)
    page.goto(f"{base}/costs/?since=2026-11-01&until=2026-11-30")

    expect(page.locator("h1")).to_have_text("Costs")
    expect(page.locator("svg.chart.stacked rect.segment").first).to_be_visible()
    expect(page.locator('#spend-table tr[data-group="idle"]')).to_be_visible()
    expect(page.locator("#spend-total")).to_contain_text("$")

    page.select_option("#costs-filters select[name=group_by]", value="pool")
    page.click("#costs-filters button[type=submit]")
    expect(page).to_have_url(re.compile(r"group_by=pool"))
    expect(page.locator('#spend-table tr[data-group="fra-h100"]')).to_be_visible()
    link = page.locator('section[aria-labelledby="groups-title"] a', has_text="CSV")
    expect(link).to_have_attribute("href", re.compile(r"/costs/spend\.csv\?.*group_by=pool"))

    page.select_option("#budget-form select[name=team]", value=str(team.pk))
    page.fill("#budget-form input[name=monthly_limit]", "2500")
    page.click("#budget-form button[type=submit]")
    expect(page.locator(".message-success")).to_contain_text("2,500.00")
    assert Budget.objects.get(team=team).monthly_limit == 2500
    expect(page.locator('#budgets-table tr[data-team="alpha"]')).to_be_visible()


@pytest.mark.usefixtures("metered")
def test_under_a_team_filter_with_idle_spread_the_tile_chart_and_table_agree(
    page, browser_login, finance_user, team
):
    base = browser_login(page, finance_user)
    page.goto(
        f"{base}/costs/?since=2026-11-01&until=2026-11-30&group_by=team"
        f"&team_id={team.pk}&idle=spread"
    )

    total = page.locator("#total-spend .tile-value")
    expect(total).to_have_text(re.compile(r"^\$[1-9][0-9,]*\.[0-9]{2}$"))
    shown = total.inner_text()
    expect(page.locator("#spend-total")).to_have_text(shown)
    expect(page.locator("#chart-total")).to_contain_text(shown)
    expect(page.locator("svg.chart.stacked rect.segment").first).to_be_visible()
    expect(page.locator("#idle-spend .tile-value")).not_to_have_text("$0.00")
    # A range wholly in the past is not asked for again.
    assert page.locator("#costs-figures").get_attribute("data-live") is None

    page.select_option("#costs-filters select[name=group_by]", value="capacity_type")
    page.click("#costs-filters button[type=submit]")
    expect(page).to_have_url(re.compile(r"group_by=capacity_type"))
    expect(page.locator("#total-spend .tile-value")).to_have_text(shown)
    expect(page.locator("#spend-total")).to_have_text(shown)
    expect(page.locator("#chart-total")).to_contain_text(shown)


def test_this_months_figures_follow_new_spend_without_a_reload(
    page, browser_login, finance_user, team
):
    import datetime as dt

    from django.utils import timezone

    from tests.apps.costs.conftest import Allocations, cloud_node, cloud_pool, cloud_price, meter

    base = browser_login(page, finance_user)
    page.goto(f"{base}/costs/?group_by=team&team_id={team.pk}&idle=spread")
    figures = page.locator("#costs-figures")
    expect(figures).to_have_attribute("data-live", "")
    expect(page.locator("#total-spend .tile-value")).to_have_text("$0.00")
    expect(page.locator("#forecast-basis")).to_contain_text("whole days")
    page.evaluate("window.notReloaded = true")

    now = timezone.now()
    pool = cloud_pool("aws-live")
    cloud_price("10", since=now - dt.timedelta(days=3))
    node = cloud_node(pool, launched=now - dt.timedelta(hours=2))
    meter(Allocations([(node.pk, 1, team.pk, 8, node.launched_at, None)]), until=now)
    # What the tab does when it is shown again (and every 30 s while it is).
    page.evaluate("htmx.trigger('#costs-figures', 'live:resume')")

    total = page.locator("#total-spend .tile-value")
    expect(total).not_to_have_text("$0.00")
    expect(page.locator("#spend-total")).to_have_text(total.inner_text())
    expect(page.locator("#chart-total")).to_contain_text(total.inner_text())
    assert page.evaluate("window.notReloaded") is True
