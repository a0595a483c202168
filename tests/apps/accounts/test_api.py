"""Teams, members, quotas and service accounts through the API: who sees and changes what."""

import json

import pytest

from apps.accounts import services
from apps.accounts.models import AuditEvent, Membership, ServiceAccount, Team, TeamQuota
from controlplane.errors import ApplicationError
from tests import factories

pytestmark = pytest.mark.django_db

TEAM_ROLES = ["admin", "researcher", "viewer"]
EVERY_ROLE = ["superuser", "ops", "finance", *TEAM_ROLES]


@pytest.fixture
def other_teams_objects(other_team):
    """Objects of a team the caller is not in."""
    stranger_admin = factories.make_member(team=other_team, role="admin")
    membership = Membership.objects.get(user=stranger_admin, team=other_team)
    quota = services.team_quota_set(team=other_team, gpu_type="H100", max_gpus=8, by=None)
    account = services.service_account_create(team=other_team, name="ci", by=None)
    token, _ = services.api_token_create(
        user=account.user, name="ci", scopes=["submit"], by=stranger_admin
    )
    return {
        "teams": other_team.pk,
        "memberships": membership.pk,
        "team-quotas": quota.pk,
        "service-accounts": account.pk,
        "tokens": token.pk,
    }


# Who may read another team's objects: team roles see nothing of it (404, not 403,
# so its existence is not revealed); ops and finance see teams, members and quotas;
# tokens stay with their owners and the owning team's admins.
VISIBLE_ACROSS_TEAMS = {
    "superuser": {"teams", "memberships", "team-quotas", "service-accounts", "tokens"},
    "ops": {"teams", "memberships", "team-quotas", "service-accounts"},
    "finance": {"teams", "memberships", "team-quotas"},
    "admin": set(),
    "researcher": set(),
    "viewer": set(),
}


@pytest.mark.parametrize("role", EVERY_ROLE)
@pytest.mark.parametrize(
    "kind", ["teams", "memberships", "team-quotas", "service-accounts", "tokens"]
)
def test_each_role_against_another_teams_objects(
    role, kind, user_for_role, api_for, other_teams_objects
):
    client = api_for(user_for_role(role))
    object_id = other_teams_objects[kind]
    detail = client.get(f"/api/v1/{kind}/{object_id}/")
    listed_ids = {
        row["id"] for row in client.get(f"/api/v1/{kind}/?page_size=1000").json()["results"]
    }
    if kind in VISIBLE_ACROSS_TEAMS[role]:
        assert detail.status_code == 200
        assert object_id in listed_ids
    else:
        assert detail.status_code == 404, detail.content
        assert detail.json()["error"]["code"] == "not_found"
        assert object_id not in listed_ids


@pytest.mark.parametrize("role", ["ops", "finance", *TEAM_ROLES])
def test_no_role_but_superuser_changes_another_teams_objects(
    role, user_for_role, api_for, other_team, other_teams_objects
):
    client = api_for(user_for_role(role))
    response = client.patch(
        f"/api/v1/teams/{other_team.pk}/", {"description": "taken over"}, format="json"
    )
    assert response.status_code in (403, 404)
    response = client.delete(f"/api/v1/memberships/{other_teams_objects['memberships']}/")
    assert response.status_code in (403, 404)
    assert Team.objects.get(pk=other_team.pk).description == ""
    assert Membership.objects.filter(pk=other_teams_objects["memberships"]).exists()


def test_team_admin_adds_a_member_and_the_audit_log_says_who(team, team_admin, api_for):
    newcomer = factories.make_user(username="newcomer")
    response = api_for(team_admin).post(
        "/api/v1/memberships/",
        {"team": team.pk, "user": "newcomer", "role": "researcher"},
        format="json",
        REMOTE_ADDR="10.1.2.3",
    )
    assert response.status_code == 201, response.content
    assert Membership.objects.filter(team=team, user=newcomer, role="researcher").exists()
    event = AuditEvent.objects.get(action="membership.create")
    assert event.actor == team_admin
    assert event.channel == "api"
    assert event.address == "10.1.2.3"
    assert event.team == team
    assert event.after["role"] == "researcher"


@pytest.mark.parametrize("role", ["researcher", "viewer"])
def test_researchers_and_viewers_cannot_manage_members(role, team, user_for_role, api_for):
    factories.make_user(username="newcomer")
    response = api_for(user_for_role(role)).post(
        "/api/v1/memberships/",
        {"team": team.pk, "user": "newcomer", "role": "admin"},
        format="json",
    )
    assert response.status_code == 403
    assert not Membership.objects.filter(user__username="newcomer").exists()
    assert not AuditEvent.objects.filter(action="membership.create").exists()


def test_the_last_admin_cannot_be_removed(team, team_admin, api_for):
    membership = Membership.objects.get(team=team, user=team_admin)
    response = api_for(team_admin).delete(f"/api/v1/memberships/{membership.pk}/")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "last_admin"
    assert Membership.objects.filter(pk=membership.pk).exists()


def test_only_ops_set_quotas(team, team_admin, ops_user, api_for):
    body = {"team": team.pk, "gpu_type": "H100", "max_gpus": 64}
    assert api_for(team_admin).post("/api/v1/team-quotas/", body, format="json").status_code == 403
    response = api_for(ops_user).post("/api/v1/team-quotas/", body, format="json")
    assert response.status_code == 201, response.content
    assert TeamQuota.objects.get(team=team, gpu_type="H100").max_gpus == 64
    again = api_for(ops_user).post("/api/v1/team-quotas/", {**body, "max_gpus": 16}, format="json")
    assert again.status_code == 201
    assert TeamQuota.objects.get(team=team, gpu_type="H100").max_gpus == 16


def test_service_account_belongs_to_its_team(team, team_admin, api_for):
    response = api_for(team_admin).post(
        "/api/v1/service-accounts/", {"team": team.pk, "name": "ci"}, format="json"
    )
    assert response.status_code == 201, response.content
    account = ServiceAccount.objects.get(pk=response.json()["id"])
    assert account.user.memberships.get().team == team
    assert not account.user.has_usable_password()


def test_a_service_account_cannot_be_made_team_admin(team, team_admin, api_for):
    account = services.service_account_create(team=team, name="ci", by=team_admin)
    membership = account.user.memberships.get()
    response = api_for(team_admin).patch(
        f"/api/v1/memberships/{membership.pk}/", {"role": "admin"}, format="json"
    )
    assert response.status_code == 400, response.content
    assert "role" in response.json()["error"]["details"]
    assert Membership.objects.get(pk=membership.pk).role == "researcher"
    with pytest.raises(ApplicationError) as refused:
        services.membership_create(team=team, user=account.user, role="admin", by=team_admin)
    assert "role" in refused.value.details


def test_the_admin_cannot_make_a_service_account_team_admin(client, superuser, team):
    account = services.service_account_create(team=team, name="ci", by=None)
    membership = account.user.memberships.get()
    client.force_login(superuser)
    client.post(
        f"/admin/accounts/membership/{membership.pk}/change/",
        {"user": account.user.pk, "team": team.pk, "role": "admin"},
    )
    assert Membership.objects.get(pk=membership.pk).role == "researcher"


def test_me_names_roles_and_teams(team, team_admin, api_for):
    me = api_for(team_admin).get("/api/v1/me/").json()
    assert me["teams"] == [{"id": team.pk, "slug": team.slug, "role": "admin"}]
    assert me["org_roles"] == []


# --- bad input: 400 with the field and the reason, and nothing written ----------------


BAD_TEAM_BODIES = [
    ({"name": "Gamma", "slug": "gamma", "colour": "red"}, "colour", "Unknown field."),
    ({"name": "Gam\x00ma", "slug": "gamma"}, "name", "Null characters are not allowed."),
    ({"name": "Gamma\ud800", "slug": "gamma"}, "name", "valid Unicode"),
    ({"name": "Gamma", "slug": "Not A Slug"}, "slug", "lowercase"),
    ({"name": "Gamma"}, "slug", "required"),
    ({"name": "x" * 101, "slug": "gamma"}, "name", "100"),
    ({"name": 7, "slug": "gamma"}, None, None),  # DRF coerces numbers to text: accepted
]


@pytest.mark.parametrize(("body", "field", "reason"), BAD_TEAM_BODIES)
def test_bad_team_input_is_a_400_naming_the_field(body, field, reason, ops_user, api_for):
    client = api_for(ops_user)
    before = (Team.objects.count(), AuditEvent.objects.count())
    # json.dumps escapes a lone surrogate as \\ud800, as a real client would send it.
    response = client.post("/api/v1/teams/", json.dumps(body), content_type="application/json")
    if field is None:
        assert response.status_code == 201
        return
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert field in error["details"]
    assert reason in " ".join(error["details"][field])
    assert (Team.objects.count(), AuditEvent.objects.count()) == before


def test_an_integer_beyond_the_column_is_a_400(team, ops_user, api_for):
    response = api_for(ops_user).post(
        "/api/v1/team-quotas/",
        {"team": team.pk, "gpu_type": "H100", "max_gpus": 2**40},
        format="json",
    )
    assert response.status_code == 400
    assert "max_gpus" in response.json()["error"]["details"]
    assert not TeamQuota.objects.exists()


def test_a_body_that_is_not_json_is_refused(ops_user, api_for):
    response = api_for(ops_user).post(
        "/api/v1/teams/", "name=x&slug=x", content_type="application/x-www-form-urlencoded"
    )
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_broken_json_is_a_400(ops_user, api_for):
    response = api_for(ops_user).post(
        "/api/v1/teams/", '{"name": ', content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"


def test_a_huge_id_in_the_path_is_a_404_not_a_500(ops_user, api_for):
    client = api_for(ops_user)
    assert client.get("/api/v1/teams/99999999999999999999999/").status_code == 404
    assert client.get("/api/v1/teams/abc/").status_code == 404


@pytest.mark.parametrize(
    ("since", "ok"),
    [
        ("1480-07-24T00:15:00.8-19:48", True),  # ISO allows it, PostgreSQL's offsets do not
        ("9999-12-31T23:59:59-10:00", False),  # past the end of time once in UTC
        ("yesterday", False),
    ],
)
def test_audit_time_filters_are_turned_into_utc_or_refused(since, ok, ops_user, api_for):
    response = api_for(ops_user).get("/api/v1/audit-events/", {"since": since})
    assert response.status_code == (200 if ok else 400), response.content
    if not ok:
        assert "since" in response.json()["error"]["details"]
