"""The costs API per role: finance writes prices and budgets (and nothing else), team admins
set their own team's budget, ops read, team roles see only their teams (404 for others)."""

from decimal import Decimal

import pytest

from apps.accounts.models import AuditEvent
from apps.costs.models import Budget, BudgetAlert, OwnedPrice, UsageEntry
from tests import factories
from tests.apps.costs.conftest import at, owned_pool

pytestmark = pytest.mark.django_db

RANGE = "since=2026-11-01&until=2026-11-30"


def owned_price_body(pool) -> dict:
    return {
        "pool": pool.pk,
        "effective_from": at(100).isoformat(),
        "purchase_price": "280000.00",
        "depreciation_months": 48,
        "electricity_per_kwh": "0.11",
        "pue": "1.25",
        "overhead_per_month": "1200.00",
        "source": "PO 2026-114",
    }


@pytest.mark.parametrize(
    ("role", "status"),
    [("finance", 201), ("superuser", 201), ("ops", 403), ("admin", 403), ("researcher", 403)],
)
def test_only_finance_writes_the_price_book(role, status, user_for_role, api_for):
    pool = owned_pool()
    client = api_for(user_for_role(role))

    made = client.post("/api/v1/owned-prices/", owned_price_body(pool), format="json")

    assert made.status_code == status, made.content
    assert OwnedPrice.objects.exists() == (status == 201)
    if status == 201:
        rate = made.json()["rate"]
        amortised = Decimal(280000) / (48 * 730)
        assert Decimal(rate["amortised"]) == amortised.quantize(Decimal("0.000001"))
        assert AuditEvent.objects.filter(action="ownedprice.create").exists()


def test_everyone_reads_the_price_book_with_the_seeded_p5_price(viewer, api_for):
    prices = api_for(viewer, scopes=("read",)).get("/api/v1/cloud-prices/").json()["results"]

    p5 = next(p for p in prices if p["instance_type_name"] == "p5.48xlarge")
    assert (p5["region"], p5["per_hour"]) == ("us-east-1", "55.040000")
    assert "aws.amazon.com" in p5["source"] and "2026-12-01" in p5["source"]


def test_finance_changes_prices_and_nothing_else(finance_user, api_for):
    client = api_for(finance_user)
    price = client.get("/api/v1/cloud-prices/").json()["results"][0]

    edited = client.patch(
        f"/api/v1/cloud-prices/{price['id']}/", {"per_hour": "54.00"}, format="json"
    )
    pool = client.post(
        "/api/v1/pools/",
        {"name": "x", "slug": "x", "kind": "owned", "gpu_type": "H100"},
        format="json",
    )

    assert edited.status_code == 200 and edited.json()["per_hour"] == "54.000000"
    assert pool.status_code == 403
    assert client.get("/api/v1/spend/").status_code == 200


def test_a_discount_is_for_cloud_pools_only(finance_user, api_for):
    owned = owned_pool()
    refused = api_for(finance_user).post(
        "/api/v1/pool-discounts/",
        {"pool": owned.pk, "effective_from": at(0).isoformat(), "percent": "12.5"},
        format="json",
    )
    assert refused.status_code == 400
    assert "pool" in refused.json()["error"]["details"]


def test_the_ledger_is_scoped_to_your_teams_and_idle_is_for_ops_and_finance(
    metered, researcher, ops_user, finance_user, api_for, other_team
):
    mine = api_for(researcher).get("/api/v1/usage/?page_size=1000").json()
    everything = api_for(ops_user).get("/api/v1/usage/?page_size=1000").json()
    theirs = UsageEntry.objects.filter(team=other_team).first()

    assert mine["count"] and {r["kind"] for r in mine["results"]} == {"job"}
    assert {r["team"] for r in mine["results"]} == {researcher.memberships.get().team_id}
    assert everything["count"] == UsageEntry.objects.count()
    assert "idle" in {r["kind"] for r in everything["results"]}
    assert api_for(researcher).get(f"/api/v1/usage/{theirs.pk}/").status_code == 404
    assert api_for(finance_user).get(f"/api/v1/usage/{theirs.pk}/").status_code == 200
    filtered = api_for(finance_user).get(f"/api/v1/usage/?kind=idle&{RANGE}").json()
    assert filtered["count"] == UsageEntry.objects.filter(kind="idle").count()


def test_finance_corrects_a_row_with_a_new_row(metered, finance_user, ops_user, api_for):
    row = UsageEntry.objects.filter(kind="job").first()
    body = {"amount": "-1.25", "note": "credit for the outage of Nov 2"}

    refused = api_for(ops_user).post(f"/api/v1/usage/{row.pk}/correct/", body, format="json")
    made = api_for(finance_user).post(f"/api/v1/usage/{row.pk}/correct/", body, format="json")

    assert refused.status_code == 403
    assert made.status_code == 201, made.content
    assert made.json()["corrects"] == row.pk and made.json()["amount"] == "-1.250000000"
    row.refresh_from_db()
    assert UsageEntry.objects.filter(corrects=row).count() == 1
    spend = api_for(finance_user).get(f"/api/v1/spend/?{RANGE}").json()
    assert Decimal(spend["total"]) == Decimal("12.121644") * 48 + Decimal("55.04") * 48 - Decimal(
        "1.25"
    )


def test_spend_groups_and_scopes(metered, finance_user, researcher, api_for, team, other_team):
    every = api_for(finance_user).get(f"/api/v1/spend/?{RANGE}").json()
    pools = api_for(finance_user).get(f"/api/v1/spend/?{RANGE}&group_by=pool").json()
    mine = api_for(researcher).get(f"/api/v1/spend/?{RANGE}").json()

    assert {r["label"] for r in every["rows"]} == {"alpha", "beta", "idle"}
    assert Decimal(every["total"]) == Decimal(every["jobs"]) + Decimal(every["idle"])
    assert Decimal(pools["total"]) == Decimal(every["total"])
    assert {r["label"] for r in mine["rows"]} == {"alpha"}
    assert Decimal(mine["idle"]) == 0
    hidden = api_for(researcher).get(f"/api/v1/spend/?{RANGE}&team_id={other_team.pk}")
    assert hidden.status_code == 404
    bad = api_for(finance_user).get("/api/v1/spend/?since=2026-11-30&until=2026-11-01")
    assert bad.status_code == 400 and "until" in bad.json()["error"]["details"]
    daily = api_for(finance_user).get(f"/api/v1/spend/daily/?{RANGE}").json()
    assert sum(Decimal(d["amount"]) for d in daily) == Decimal(every["total"])


def test_top_jobs_are_your_teams_jobs(metered, researcher, finance_user, api_for):
    assert [
        j["job"] for j in api_for(finance_user).get(f"/api/v1/spend/top-jobs/?{RANGE}").json()
    ] == [
        2,
        1,
    ]
    assert [
        j["job"] for j in api_for(researcher).get(f"/api/v1/spend/top-jobs/?{RANGE}").json()
    ] == [1]


@pytest.mark.parametrize(
    ("role", "own", "other"),
    [
        ("finance", 201, 201),
        ("admin", 201, 400),  # another team is not even visible to a team admin
        ("researcher", 403, 400),
        ("ops", 403, 403),
    ],
)
def test_who_sets_budgets(role, own, other, user_for_role, api_for, team, other_team):
    client = api_for(user_for_role(role))

    for target, status in ((team, own), (other_team, other)):
        made = client.post(
            "/api/v1/budgets/", {"team": target.pk, "monthly_limit": "5000"}, format="json"
        )
        assert made.status_code == status, (target.slug, made.content)
    assert Budget.objects.filter(team=team).exists() == (own == 201)


def test_a_budget_webhook_key_is_shown_once_and_never_logged(team_admin, team, api_for, settings):
    settings.WEBHOOK_ALLOW_HTTP = False
    settings.WEBHOOK_ALLOW_PRIVATE = True  # hooks.example does not resolve here (no DNS)
    client = api_for(team_admin)
    body = {"team": team.pk, "monthly_limit": "100", "webhook_url": "https://hooks.example/b"}

    made = client.post("/api/v1/budgets/", body, format="json")
    listed = client.get("/api/v1/budgets/").json()["results"][0]
    changed = client.patch(
        f"/api/v1/budgets/{listed['id']}/", {"monthly_limit": "200"}, format="json"
    )
    plain = client.post(
        "/api/v1/budgets/", {**body, "webhook_url": "http://hooks.example/b"}, format="json"
    )

    assert made.status_code == 201 and len(made.json()["webhook_signing_key"]) > 20
    assert "webhook_signing_key" not in listed
    assert changed.status_code == 200 and changed.json()["webhook_signing_key"] is None
    assert changed.json()["monthly_limit"] == "200.00"
    assert plain.status_code == 400 and "webhook_url" in plain.json()["error"]["details"]
    for event in AuditEvent.objects.filter(action="budget.set"):
        assert "webhook_signing_key" not in (event.after or {})


def test_only_who_sets_a_budget_sees_its_webhooks_credentials(
    team_admin, viewer, finance_user, team, api_for, settings
):
    settings.WEBHOOK_ALLOW_PRIVATE = True  # hooks.example does not resolve here (no DNS)
    url = "https://ci:hunter2@hooks.example/b?token=abc"
    body = {"team": team.pk, "monthly_limit": "100", "webhook_url": url}
    assert api_for(team_admin).post("/api/v1/budgets/", body, format="json").status_code == 201
    for user in (team_admin, finance_user):
        assert api_for(user).get("/api/v1/budgets/").json()["results"][0]["webhook_url"] == url
    seen = api_for(viewer, scopes=("read",)).get("/api/v1/budgets/").json()["results"][0]
    assert seen["webhook_url"] == "https://***@hooks.example/b?***"


def test_a_budget_webhook_into_our_own_network_is_refused(team_admin, team, api_for, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    body = {"team": team.pk, "monthly_limit": "100", "webhook_url": "https://10.0.0.5/alerts"}
    made = api_for(team_admin).post("/api/v1/budgets/", body, format="json")
    assert made.status_code == 400
    assert "private address" in str(made.json()["error"]["details"]["webhook_url"])
    assert not Budget.objects.filter(team=team).exists()


def test_budgets_and_alerts_of_other_teams_are_not_found(
    researcher, team, other_team, api_for, finance_user
):
    from apps.costs import services

    mine, _ = services.budget_set(team=team, monthly_limit=Decimal(1), by=finance_user)
    theirs, _ = services.budget_set(team=other_team, monthly_limit=Decimal(1), by=finance_user)
    BudgetAlert.objects.create(
        team=other_team,
        month=at(0).date().replace(day=1),
        threshold=50,
        spent=Decimal(1),
        monthly_limit=Decimal(1),
        at=at(0),
    )
    client = api_for(researcher)

    assert client.get(f"/api/v1/budgets/{mine.pk}/").status_code == 200
    assert client.get(f"/api/v1/budgets/{theirs.pk}/").status_code == 404
    assert client.get("/api/v1/budget-alerts/").json()["count"] == 0
    assert api_for(finance_user).get("/api/v1/budget-alerts/").json()["count"] == 1


def test_spot_prices_are_read_only(finance_user, api_for):
    response = api_for(finance_user).post(
        "/api/v1/spot-prices/",
        {
            "instance_type": factories.instance_type("p5.48xlarge").pk,
            "region": "us-east-1",
            "availability_zone": "us-east-1a",
            "effective_at": at(0).isoformat(),
            "per_hour": "1",
        },
        format="json",
    )
    assert response.status_code == 405


def test_dates_out_of_any_sensible_range_are_refused_not_crashed_on(finance_user, api_for):
    client = api_for(finance_user)
    pool = owned_pool()
    far = client.get("/api/v1/spend/?since=9999-12-01&until=9999-12-31")
    old = client.post(
        "/api/v1/owned-prices/",
        {**owned_price_body(pool), "effective_from": "0001-01-01T00:00:00Z"},
        format="json",
    )
    too_many = client.get("/api/v1/spend/?since=2020-01-01&until=2026-11-30")

    assert far.status_code == 400 and "since" in far.json()["error"]["details"]
    assert old.status_code == 400 and "effective_from" in old.json()["error"]["details"]
    assert too_many.status_code == 400
