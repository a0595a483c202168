"""API tokens: shown once, stored as SHA-256, scoped, expiring, revocable."""

import datetime as dt
import hashlib

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts import services
from apps.accounts.models import ApiToken, AuditEvent
from controlplane.errors import ApplicationError
from tests import factories

pytestmark = pytest.mark.django_db


def test_the_secret_is_returned_once_and_only_its_sha256_is_stored(researcher, api_for):
    client = api_for(researcher)
    response = client.post("/api/v1/tokens/", {"name": "ci", "scopes": ["read"]}, format="json")
    assert response.status_code == 201, response.content
    secret = response.json()["token"]
    assert secret.startswith("cp_") and len(secret) > 40
    row = ApiToken.objects.get(pk=response.json()["id"])
    assert row.digest == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in str(list(ApiToken.objects.values()))
    listed = client.get(f"/api/v1/tokens/{row.pk}/").json()
    assert "token" not in listed and listed["prefix"] == secret[:11]
    audit = AuditEvent.objects.get(action="api_token.create", object_id=str(row.pk))
    assert "digest" not in audit.after and secret not in str(audit.after)


def test_a_new_token_authenticates(researcher, anon_api):
    _, secret = services.api_token_create(user=researcher, name="t", scopes=["read"], by=researcher)
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    me = anon_api.get("/api/v1/me/")
    assert me.status_code == 200
    assert me.json()["username"] == researcher.username
    assert me.json()["token_scopes"] == ["read"]


@pytest.mark.parametrize("state", ["expired", "revoked", "unknown", "malformed"])
def test_expired_revoked_or_unknown_tokens_get_401(state, researcher, anon_api):
    token, secret = services.api_token_create(
        user=researcher, name="t", scopes=["admin"], by=researcher
    )
    if state == "expired":
        ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
    elif state == "revoked":
        services.api_token_revoke(token=token, by=researcher)
    elif state == "unknown":
        secret = secret[:-4] + "AAAA"
    else:
        secret = "two words"
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = anon_api.get("/api/v1/teams/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "authentication_failed"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_no_credentials_is_401_with_the_error_shape(anon_api):
    response = anon_api.get("/api/v1/nodes/")
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"code", "message", "details"}


def test_last_used_is_written_at_most_once_a_minute(researcher):
    token, secret = services.api_token_create(
        user=researcher, name="t", scopes=["read"], by=researcher
    )
    start = timezone.now()
    services.api_token_use(raw=secret, now=start)
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    assert first == start
    with CaptureQueriesContext(connection) as queries:  # a look-up at most, no UPDATE
        services.api_token_use(raw=secret, now=start + dt.timedelta(seconds=30))
    assert len(queries) <= 1
    assert not [q for q in queries if q["sql"].startswith("UPDATE")]
    assert ApiToken.objects.get(pk=token.pk).last_used_at == start
    later = start + dt.timedelta(seconds=61)
    services.api_token_use(raw=secret, now=later)
    assert ApiToken.objects.get(pk=token.pk).last_used_at == later


def test_read_scope_cannot_write(ops_user, api_for):
    client = api_for(ops_user, scopes=("read",))
    assert client.get("/api/v1/sites/").status_code == 200
    response = client.post("/api/v1/sites/", {"name": "X", "slug": "x"}, format="json")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


def test_submit_scope_is_not_admin(ops_user, api_for):
    client = api_for(ops_user, scopes=("submit",))
    response = client.post("/api/v1/sites/", {"name": "X", "slug": "x"}, format="json")
    assert response.status_code == 403


def test_delete_revokes_and_keeps_the_row(researcher, api_for):
    client = api_for(researcher)
    made = client.post("/api/v1/tokens/", {"name": "old", "scopes": ["read"]}, format="json")
    token_id = made.json()["id"]
    assert client.delete(f"/api/v1/tokens/{token_id}/").status_code == 204
    row = ApiToken.objects.get(pk=token_id)
    assert row.revoked_at is not None


def test_expiry_in_the_past_is_refused(researcher, api_for):
    client = api_for(researcher)
    before = ApiToken.objects.count()
    response = client.post(
        "/api/v1/tokens/",
        {"name": "x", "scopes": ["read"], "expires_at": "2001-01-01T00:00:00Z"},
        format="json",
    )
    assert response.status_code == 400
    assert "expires_at" in response.json()["error"]["details"]
    assert ApiToken.objects.count() == before


def test_team_admin_makes_tokens_for_the_teams_service_account(team, team_admin, api_for):
    account = services.service_account_create(team=team, name="ci", by=team_admin)
    client = api_for(team_admin)
    response = client.post(
        "/api/v1/tokens/",
        {"name": "pipeline", "scopes": ["submit"], "service_account": account.pk},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["username"] == account.user.username


def test_a_researcher_cannot_make_tokens_for_a_service_account(
    team, team_admin, researcher, api_for
):
    account = services.service_account_create(team=team, name="ci", by=team_admin)
    response = api_for(researcher).post(
        "/api/v1/tokens/",
        {"name": "pipeline", "scopes": ["submit"], "service_account": account.pk},
        format="json",
    )
    assert response.status_code == 403
    assert not ApiToken.objects.filter(user=account.user).exists()


def test_tokens_of_an_inactive_user_stop_working(anon_api):
    user = factories.make_user()
    _, secret = services.api_token_create(user=user, name="t", scopes=["read"], by=user)
    user.is_active = False
    user.save()
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert anon_api.get("/api/v1/me/").status_code == 401


def _bearer(secret):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client


def test_a_cached_token_is_refused_as_soon_as_it_is_revoked(
    researcher, django_capture_on_commit_callbacks
):
    token, secret = services.api_token_create(
        user=researcher, name="t", scopes=["read"], by=researcher
    )
    client = _bearer(secret)
    assert client.get("/api/v1/me/").status_code == 200
    assert client.get("/api/v1/me/").status_code == 200  # answered from the auth cache
    with django_capture_on_commit_callbacks(execute=True):  # the revocation commits
        services.api_token_revoke(token=token, by=researcher)
    assert client.get("/api/v1/me/").status_code == 401


def test_a_cached_token_follows_its_users_roles_and_activity(
    team, other_team, researcher, django_capture_on_commit_callbacks
):
    _, secret = services.api_token_create(user=researcher, name="t", scopes=["read"], by=None)
    client = _bearer(secret)
    assert client.get(f"/api/v1/teams/{team.pk}/").status_code == 200
    assert client.get(f"/api/v1/teams/{other_team.pk}/").status_code == 404
    # Each change commits (as in production) before the next request.
    with django_capture_on_commit_callbacks(execute=True):
        factories.make_member(team=other_team, role="viewer", user=researcher)
    assert client.get(f"/api/v1/teams/{other_team.pk}/").status_code == 200  # joined: seen at once
    with django_capture_on_commit_callbacks(execute=True):
        researcher.memberships.filter(team=team).delete()
    assert client.get(f"/api/v1/teams/{team.pk}/").status_code == 404  # left: gone at once
    with django_capture_on_commit_callbacks(execute=True):
        researcher.is_active = False
        researcher.save()
    assert client.get("/api/v1/me/").status_code == 401


# --- tokens made by tokens ------------------------------------------------------------


def test_a_token_made_by_a_token_is_capped_at_its_parents_expiry(researcher, anon_api):
    ends = timezone.now() + dt.timedelta(days=1)
    parent, secret = services.api_token_create(
        user=researcher, name="parent", scopes=["admin"], expires_at=ends, by=researcher
    )
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    before = ApiToken.objects.count()
    later = anon_api.post(
        "/api/v1/tokens/",
        {"name": "later", "scopes": ["read"], "expires_at": (ends + dt.timedelta(days=1))},
        format="json",
    )
    assert later.status_code == 400, later.content
    assert "expires_at" in later.json()["error"]["details"]
    assert ApiToken.objects.count() == before
    unsaid = anon_api.post("/api/v1/tokens/", {"name": "child", "scopes": ["read"]}, format="json")
    assert unsaid.status_code == 201, unsaid.content
    child = ApiToken.objects.get(pk=unsaid.json()["id"])
    assert child.parent_id == parent.pk and unsaid.json()["parent"] == parent.pk
    assert child.expires_at == ends


def test_a_token_made_by_a_token_has_no_scope_its_parent_lacks(researcher):
    parent, _ = services.api_token_create(
        user=researcher, name="parent", scopes=["submit"], by=researcher
    )
    with pytest.raises(ApplicationError) as refused:
        services.api_token_create(
            user=researcher, name="child", scopes=["admin"], by=researcher, parent=parent
        )
    assert "scopes" in refused.value.details
    child, _ = services.api_token_create(
        user=researcher, name="child", scopes=["read"], by=researcher, parent=parent
    )
    assert child.parent_id == parent.pk


def test_revoking_a_token_revokes_what_it_made(
    researcher, anon_api, api_for, django_capture_on_commit_callbacks
):
    parent, _ = services.api_token_create(
        user=researcher, name="leaked", scopes=["admin"], by=researcher
    )
    child, child_secret = services.api_token_create(
        user=researcher, name="child", scopes=["admin"], by=researcher, parent=parent
    )
    grandchild, grandchild_secret = services.api_token_create(
        user=researcher, name="grandchild", scopes=["read"], by=researcher, parent=child
    )
    for secret in (child_secret, grandchild_secret):  # used, so cached
        anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert anon_api.get("/api/v1/me/").status_code == 200
    with django_capture_on_commit_callbacks(execute=True):  # the revocation commits
        assert api_for(researcher).delete(f"/api/v1/tokens/{parent.pk}/").status_code == 204
    for token, secret in ((child, child_secret), (grandchild, grandchild_secret)):
        assert ApiToken.objects.get(pk=token.pk).revoked_at is not None
        anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert anon_api.get("/api/v1/me/").status_code == 401
    assert AuditEvent.objects.filter(action="api_token.revoke").count() == 3


def test_a_service_accounts_token_made_with_an_admins_token_ends_with_it(
    team, team_admin, api_for, anon_api, django_capture_on_commit_callbacks
):
    account = services.service_account_create(team=team, name="ci", by=team_admin)
    admin = api_for(team_admin)
    made = admin.post(
        "/api/v1/tokens/",
        {"name": "pipeline", "scopes": ["submit"], "service_account": account.pk},
        format="json",
    )
    assert made.status_code == 201, made.content
    parent = ApiToken.objects.get(pk=made.json()["parent"])
    with django_capture_on_commit_callbacks(execute=True):
        services.api_token_revoke(token=parent, by=team_admin)
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {made.json()['token']}")
    assert anon_api.get("/api/v1/me/").status_code == 401
    event = AuditEvent.objects.get(action="api_token.revoke", object_id=str(made.json()["id"]))
    assert event.team == team


def test_a_token_whose_parent_ended_is_refused(researcher, anon_api):
    parent, _ = services.api_token_create(
        user=researcher, name="parent", scopes=["admin"], by=researcher
    )
    _, secret = services.api_token_create(
        user=researcher, name="child", scopes=["read"], by=researcher, parent=parent
    )
    ApiToken.objects.filter(pk=parent.pk).update(expires_at=timezone.now())
    anon_api.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = anon_api.get("/api/v1/me/")
    assert response.status_code == 401
    assert "made this token" in response.json()["error"]["message"]


def test_a_token_made_in_the_browser_has_no_parent(researcher, client):
    client.force_login(researcher)
    made = client.post(
        "/api/v1/tokens/", {"name": "web", "scopes": ["admin"]}, content_type="application/json"
    )
    assert made.status_code == 201, made.content
    assert made.json()["parent"] is None
