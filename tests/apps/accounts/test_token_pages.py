"""The API tokens page: make a token (yours or a service account's), see it once, use it,
revoke it."""

import re

import pytest

from apps.accounts import services
from apps.accounts.models import ApiToken

pytestmark = pytest.mark.django_db


def logged_in(client, user):
    client.force_login(user)
    return client


def secret_on(html: str) -> str:
    match = re.search(r'<code id="new-token">(cp_[^<]+)</code>', html)
    assert match, "no new token on the page"
    return match.group(1)


def test_a_researcher_makes_a_token_sees_it_once_and_it_works(client, researcher):
    page = logged_in(client, researcher).post(
        "/tokens/", {"name": "laptop cpctl", "owner": "", "scopes": ["submit"]}
    )

    assert page.status_code == 201
    assert page["Cache-Control"] == "no-store"
    html = page.content.decode()
    secret = secret_on(html)
    token = ApiToken.objects.get(name="laptop cpctl")
    assert token.user == researcher and token.scopes == ["submit"]
    assert secret not in token.digest and token.digest == services.token_digest(secret)
    assert f"export CPCTL_TOKEN={secret}" in html

    me = client.get("/api/v1/me/", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert me.status_code == 200 and me.json()["username"] == researcher.username

    listed = logged_in(client, researcher).get("/tokens/").content.decode()
    assert f'data-token="{token.pk}"' in listed and token.prefix in listed
    assert secret not in listed  # shown once


def test_a_team_admin_makes_a_service_account_token_a_researcher_cannot(
    client, team, team_admin, researcher
):
    account = services.service_account_create(team=team, name="ci", by=team_admin)

    page = logged_in(client, team_admin).post(
        "/tokens/", {"name": "pipeline", "owner": str(account.pk), "scopes": ["submit"]}
    )
    assert page.status_code == 201
    assert ApiToken.objects.get(name="pipeline").user == account.user
    assert f"{team.slug}/ci" in page.content.decode()

    refused = logged_in(client, researcher).post(
        "/tokens/", {"name": "sneaky", "owner": str(account.pk), "scopes": ["submit"]}
    )
    assert refused.status_code == 200 and "Select a valid choice" in refused.content.decode()
    assert not ApiToken.objects.filter(name="sneaky").exists()


def test_bad_input_makes_no_token_and_says_why(client, researcher):
    page = logged_in(client, researcher).post(
        "/tokens/", {"name": "", "owner": "", "scopes": [], "expires_in_days": "0"}
    )
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count('class="field-error"') == 3  # name, scopes, expiry
    assert ApiToken.objects.count() == 0


def test_revoking_ends_the_token_and_others_tokens_are_not_yours_to_revoke(
    client, researcher, viewer
):
    token, secret = services.api_token_create(
        user=researcher, name="old", scopes=["read"], by=researcher
    )
    theirs, _ = services.api_token_create(user=viewer, name="theirs", scopes=["read"], by=viewer)

    client = logged_in(client, researcher)
    assert client.post(f"/tokens/{theirs.pk}/revoke/").status_code == 404
    assert client.post(f"/tokens/{token.pk}/revoke/").status_code == 302

    token.refresh_from_db()
    theirs.refresh_from_db()
    assert token.revoked_at is not None and theirs.revoked_at is None
    assert client.get("/api/v1/me/", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 401
    assert "Revoked" in client.get("/tokens/").content.decode()


def test_every_page_links_to_the_tokens(client, viewer):
    html = logged_in(client, viewer).get("/jobs/").content.decode()
    assert '<a class="account-link" href="/tokens/">API tokens</a>' in html


def test_the_tokens_csv_lists_what_the_page_does_without_secrets(client, researcher, viewer):
    import csv
    import io

    token, secret = services.api_token_create(
        user=researcher, name="ci", scopes=["read", "submit"], by=researcher
    )
    services.api_token_create(user=viewer, name="theirs", scopes=["read"], by=viewer)

    response = logged_in(client, researcher).get("/tokens/tokens.csv")

    rows = list(csv.reader(io.StringIO(response.content.decode())))
    assert rows[0][:5] == ["id", "name", "owner", "prefix", "scopes"]
    assert [row[:5] for row in rows[1:]] == [
        [str(token.pk), "ci", researcher.username, token.prefix, "read submit"]
    ]
    assert secret not in response.content.decode()


def _admin_of_teams(admin, *, teams: int, accounts_per_team: int = 2) -> None:
    """More teams the admin administers, each with service accounts that have tokens, and
    tokens of the admin's own: what an N+1 on the tokens page would pay for once each."""
    from tests import factories

    for _ in range(teams):
        team = factories.make_team()
        services.membership_create(team=team, user=admin, role="admin", by=None)
        for n in range(accounts_per_team):
            account = services.service_account_create(team=team, name=f"ci-{n}", by=admin)
            for scope in ("read", "submit"):
                services.api_token_create(
                    user=account.user, name=f"{scope} token", scopes=[scope], by=admin
                )
        services.api_token_create(user=admin, name=f"mine {team.slug}", scopes=["read"], by=admin)


def test_the_tokens_page_makes_as_many_queries_for_one_team_as_for_many(
    client, team_admin, django_assert_max_num_queries
):
    _admin_of_teams(team_admin, teams=1)
    logged_in(client, team_admin).get("/tokens/")  # warm
    # The session, the user, their roles, the service accounts they make tokens for, the
    # navigation's budget alerts, the tokens with their owners and teams: none per token.
    with django_assert_max_num_queries(6) as one_team:
        assert client.get("/tokens/").status_code == 200
    _admin_of_teams(team_admin, teams=5)
    with django_assert_max_num_queries(len(one_team.captured_queries)):
        html = client.get("/tokens/").content.decode()
    assert html.count("data-token=") == 6 * 5
