"""The Costs page: charts, tables, budgets and the price book, and its CSV exports with the
page's filters; the banner members see; the Job page's cost."""

import csv
import datetime as dt
import io
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.test import Client
from django.utils import timezone

from apps.accounts.secrets import decrypt
from apps.costs import selectors, services
from apps.costs.models import Budget
from tests import factories
from tests.apps.costs.conftest import (
    Allocations,
    at,
    cloud_node,
    cloud_pool,
    cloud_price,
    meter,
    owned_pool,
)

pytestmark = pytest.mark.django_db


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def csv_rows(response) -> list[list[str]]:
    body = b"".join(
        chunk if isinstance(chunk, bytes) else chunk.encode()
        for chunk in response.streaming_content
    )
    return list(csv.reader(io.StringIO(body.decode())))


RANGE = "since=2026-11-01&until=2026-11-30"


def test_finance_sees_spend_by_team_with_idle_charts_and_the_price_book(finance_user, metered):
    page = browser(finance_user).get(f"/costs/?{RANGE}")

    assert page.status_code == 200
    text = page.content.decode()
    assert '<svg class="chart stacked"' in text
    assert 'id="spend-table"' in text and 'data-group="idle"' in text
    assert 'data-group="alpha"' in text and 'data-group="beta"' in text
    assert "p5.48xlarge" in text and "55.04" in text
    assert 'id="owned-price-form"' in text  # finance edits the price book


def test_the_spend_csv_has_the_pages_filters_and_adds_up(finance_user, metered, team):
    client = browser(finance_user)
    every = csv_rows(client.get(f"/costs/spend.csv?{RANGE}"))
    only_alpha = csv_rows(client.get(f"/costs/spend.csv?{RANGE}&team_id={team.pk}"))
    by_pool = csv_rows(client.get(f"/costs/spend.csv?{RANGE}&group_by=pool"))

    assert every[0] == ["team", "jobs", "idle", "total", "gpu_hours", "spot_savings"]
    assert {r[0] for r in every[1:]} == {"alpha", "beta", "idle"}
    assert [r[0] for r in only_alpha[1:]] == ["alpha"]
    assert {r[0] for r in by_pool[1:]} == {"fra-h100", "aws-p5"}
    total = sum(Decimal(r[3]) for r in every[1:])
    assert total == sum(Decimal(r[3]) for r in by_pool[1:])
    owned_rate, cloud_rate = Decimal("12.121644"), Decimal("55.04")
    assert total == owned_rate * 48 + cloud_rate * 48


def test_every_table_exports_as_csv(finance_user, metered):
    client = browser(finance_user)
    for path, first in [
        ("spend-by-day.csv", ["day", "team", "amount"]),
        ("top-jobs.csv", ["job", "name", "team", "amount", "gpu_hours"]),
        ("budgets.csv", ["team", "month", "monthly_limit", "spent", "percent", "forecast"]),
        ("prices.csv", ["kind", "pool", "instance_type", "region_or_zone"]),
    ]:
        rows = csv_rows(client.get(f"/costs/{path}?{RANGE}"))
        assert rows[0][: len(first)] == first, path


def test_the_ledger_csv_is_streamed_with_the_pages_filters(finance_user, metered, team):
    client = browser(finance_user)
    response = client.get(f"/costs/usage.csv?{RANGE}&team_id={team.pk}")

    assert response.streaming
    rows = csv_rows(response)
    header, body = rows[0], rows[1:]
    assert header[:4] == ["id", "day", "start", "end"]
    assert body and {r[header.index("team_id")] for r in body} == {str(team.pk)}
    amount = header.index("amount")
    assert sum(Decimal(r[amount]) for r in body) == Decimal("12.121644") * 24
    assert body[0][header.index("start")] == "2026-11-02 00:00:00+00"  # alike on both databases


def test_a_researcher_sees_only_their_teams_spend_and_no_idle(researcher, metered, other_team):
    client = browser(researcher)
    page = client.get(f"/costs/?{RANGE}")
    text = page.content.decode()

    assert page.status_code == 200
    assert 'data-group="alpha"' in text
    assert 'data-group="beta"' not in text and 'data-group="idle"' not in text
    assert client.get(f"/costs/?{RANGE}&team_id={other_team.pk}").status_code == 404
    assert client.get(f"/costs/spend.csv?{RANGE}&team_id={other_team.pk}").status_code == 404
    assert 'id="owned-price-form"' not in text


def test_idle_spread_over_teams_in_proportion_to_use(finance_user, metered):
    rows = csv_rows(browser(finance_user).get(f"/costs/spend.csv?{RANGE}&idle=spread"))
    by_team = {r[0]: r for r in rows[1:]}

    assert set(by_team) == {"alpha", "beta"}
    jobs = {t: Decimal(r[1]) for t, r in by_team.items()}
    idle = {t: Decimal(r[2]) for t, r in by_team.items()}
    assert idle["alpha"] / idle["beta"] == pytest.approx(jobs["alpha"] / jobs["beta"])
    whole = Decimal("12.121644") * 48 + Decimal("55.04") * 48
    assert sum(Decimal(r[3]) for r in by_team.values()) == pytest.approx(whole, abs=Decimal("1e-6"))


def test_a_team_admin_sets_their_teams_budget_on_the_page(team_admin, team, other_team):
    client = browser(team_admin)
    done = client.post(
        "/costs/budgets/", {"team": team.pk, "monthly_limit": "1000", "notify_emails": ""}
    )
    refused = client.post("/costs/budgets/", {"team": other_team.pk, "monthly_limit": "1"})

    assert done.status_code == 302
    assert Budget.objects.get(team=team).monthly_limit == Decimal(1000)
    assert refused.status_code == 302 and not Budget.objects.filter(team=other_team).exists()


def test_a_budget_webhook_key_is_shown_on_the_answer_and_never_put_in_a_cookie(
    team_admin, team, settings
):
    settings.WEBHOOK_ALLOW_PRIVATE = True  # hooks.example does not resolve here (no DNS)
    client = browser(team_admin)
    done = client.post(
        "/costs/budgets/",
        {"team": team.pk, "monthly_limit": "100", "webhook_url": "https://hooks.example/b"},
    )
    key = decrypt(Budget.objects.get(team=team).webhook_signing_key)

    assert done.status_code == 201
    assert key in done.content.decode()
    assert "no-store" in done["Cache-Control"]
    assert key not in str(done.cookies) and key not in str(client.cookies)
    assert key not in client.get("/costs/").content.decode()  # shown once


def test_members_see_a_banner_once_their_budget_passes_a_threshold(researcher, team):
    now = timezone.now()
    pool = cloud_pool("aws-now")
    cloud_price("100", since=now - dt.timedelta(days=40))
    node = cloud_node(pool, launched=now - dt.timedelta(hours=1))
    meter(Allocations([(node.pk, 1, team.pk, 8, node.launched_at, None)]), until=now)
    month = selectors.month_start()
    spent = selectors.team_spend(since=month, until=month + dt.timedelta(days=31))[team.pk]
    services.budget_set(
        team=team, monthly_limit=(spent / Decimal("0.9")).quantize(Decimal("0.01")), by=None
    )
    services.budgets_check()
    page = browser(researcher).get("/jobs/")

    assert b"budget-banner" in page.content
    assert b"has spent 80% or more" in page.content
    outsider = factories.make_member(team=factories.make_team(slug="gamma"))
    assert b"budget-banner" not in browser(outsider).get("/jobs/").content


def test_whole_months_come_from_the_monthly_roll_up_and_agree_with_the_days(finance_user):
    from apps.costs.models import DailySpend, MonthlySpend

    pool = cloud_pool("aws-long")
    cloud_price("2", since=at(-24 * 40))
    cloud_node(pool, launched=at(-24 * 35))  # from Sep 28 to Nov 4
    meter(until=at(48))
    client = browser(finance_user)

    def total(since, until):
        rows = csv_rows(client.get(f"/costs/spend.csv?since={since}&until={until}"))
        return sum(Decimal(r[3]) for r in rows[1:])

    assert MonthlySpend.objects.filter(month="2026-10-01").exists()
    assert total("2026-09-28", "2026-11-03") == Decimal(2) * 24 * 37
    assert total("2026-10-01", "2026-10-31") == Decimal(2) * 24 * 31
    assert total("2026-10-05", "2026-11-01") == Decimal(2) * 24 * 28
    # The monthly rows hold what the daily ones do.
    assert (
        MonthlySpend.objects.aggregate(s=Sum("amount"))["s"]
        == (DailySpend.objects.aggregate(s=Sum("amount"))["s"])
    )


def test_the_demo_gets_an_owned_price_per_owned_pool_once():
    from django.core.management import call_command

    from apps.costs.models import OwnedPrice

    pools = [owned_pool("demo-a"), owned_pool("demo-b")]
    call_command("demo_prices")
    call_command("demo_prices")

    assert sorted(OwnedPrice.objects.values_list("pool_id", flat=True)) == [p.pk for p in pools]
    assert "Demo figures" in OwnedPrice.objects.first().source


def test_a_bad_filter_is_a_400_for_csv_and_a_message_on_the_page(finance_user):
    client = browser(finance_user)

    csv_answer = client.get("/costs/spend.csv?since=2026-11-30&until=2026-11-01")
    page = client.get("/costs/?group_by=colour", follow=True)

    assert csv_answer.status_code == 400 and b"until" in csv_answer.content
    assert page.status_code == 200 and b"group_by" in page.content


def test_with_many_teams_the_budget_form_waits_for_a_team_chosen_in_the_filters(
    finance_user, team, other_team, monkeypatch
):
    from apps.costs import views

    monkeypatch.setattr(views, "BUDGET_FORM_TEAMS", 1)
    client = browser(finance_user)
    page = client.get("/costs/").content.decode()
    assert 'id="budget-pick-team"' in page and 'id="budget-form"' not in page
    chosen = client.get(f"/costs/?team_id={other_team.pk}").content.decode()
    form = chosen[chosen.index('id="budget-form"') :]
    form = form[: form.index("</form>")]
    assert f'<option value="{other_team.pk}" selected>' in form
    assert f'value="{team.pk}"' not in form


def test_the_table_by_group_shows_the_largest_groups_and_the_rest_as_one_row(
    finance_user, team, other_team, monkeypatch
):
    import re

    from apps.costs import views
    from tests.apps.costs.test_budgets import spend

    monkeypatch.setattr(views, "TABLE_ROWS", 1)
    spend(team, Decimal(30))
    spend(other_team, Decimal(10), pool_slug="other-pool")
    html = browser(finance_user).get("/costs/?group_by=team&idle=separate").content.decode()
    start = html.index('id="spend-table"')
    table = html[start : html.index("</table>", start)]
    assert table.count("<tr data-group=") == 1
    rest = table[table.index('id="spend-rest"') :]
    assert re.search(r"<td>\d+ more, each in the <a", rest)

    def strong(text: str) -> Decimal:
        return Decimal(re.search(r"<strong>\$([\d,.]+)</strong>", text)[1].replace(",", ""))

    shown_total = Decimal(re.search(r'id="spend-total">\$([\d,.]+)<', table)[1].replace(",", ""))
    assert strong(table) + strong(rest) == shown_total > 0
