"""Team secrets: encrypted at rest, set by team admins, named by jobs, never shown."""

import json

import pytest

from apps.accounts import services
from apps.accounts.models import AuditEvent, TeamSecret
from apps.accounts.secrets import MASK, mask
from tests import factories

pytestmark = pytest.mark.django_db

VALUE = "wandb-key-5f2c9a1e77d04b0c"


def test_a_team_admin_sets_a_secret_that_is_stored_encrypted(team, team_admin, api_for):
    client = api_for(team_admin)
    response = client.post(
        "/api/v1/team-secrets/",
        {"team": team.pk, "name": "WANDB_API_KEY", "value": VALUE},
        format="json",
    )
    assert response.status_code == 201, response.content
    assert "value" not in response.json()
    row = TeamSecret.objects.get(team=team, name="WANDB_API_KEY")
    assert VALUE.encode() not in bytes(row.ciphertext)
    assert services.team_secret_values(team=team, names=["WANDB_API_KEY"]) == {
        "WANDB_API_KEY": VALUE
    }
    listed = client.get("/api/v1/team-secrets/").content.decode()
    assert "WANDB_API_KEY" in listed and VALUE not in listed
    audit = json.dumps(list(AuditEvent.objects.values("before", "after")))
    assert VALUE not in audit


def test_setting_it_again_replaces_the_value(team, team_admin, api_for):
    client = api_for(team_admin)
    body = {"team": team.pk, "name": "HF_TOKEN", "value": "first-value"}
    client.post("/api/v1/team-secrets/", body, format="json")
    client.post("/api/v1/team-secrets/", {**body, "value": "second-value"}, format="json")
    assert TeamSecret.objects.filter(team=team, name="HF_TOKEN").count() == 1
    assert services.team_secret_values(team=team, names=["HF_TOKEN"])["HF_TOKEN"] == (
        "second-value"
    )


@pytest.mark.parametrize("role", ["researcher", "viewer"])
def test_researchers_and_viewers_cannot_set_secrets(role, team, user_for_role, api_for):
    response = api_for(user_for_role(role)).post(
        "/api/v1/team-secrets/",
        {"team": team.pk, "name": "X_KEY", "value": "v" * 8},
        format="json",
    )
    assert response.status_code == 403
    assert not TeamSecret.objects.exists()


def test_another_teams_secrets_are_invisible(team, other_team, researcher, api_for):
    secret = services.team_secret_set(team=other_team, name="THEIR_KEY", value=VALUE, by=None)
    client = api_for(researcher)
    assert client.get(f"/api/v1/team-secrets/{secret.pk}/").status_code == 404
    assert "THEIR_KEY" not in client.get("/api/v1/team-secrets/").content.decode()


def test_a_bad_name_is_a_400(team, team_admin, api_for):
    response = api_for(team_admin).post(
        "/api/v1/team-secrets/",
        {"team": team.pk, "name": "not a name", "value": "x"},
        format="json",
    )
    assert response.status_code == 400
    assert "name" in response.json()["error"]["details"]


def test_jobs_name_secrets_that_exist(team, researcher, api_for):
    from tests.apps.fleet.test_services import ready_node
    from tests.apps.jobs.conftest import command_spec

    ready_node(pool=factories.make_owned_pool(), gpu_count=8)
    services.team_secret_set(team=team, name="WANDB_API_KEY", value=VALUE, by=None)
    client = api_for(researcher)
    missing = client.post(
        "/api/v1/jobs/", command_spec(team, secrets=["WANDB_API_KEY", "NOPE"]), format="json"
    )
    assert missing.status_code == 400
    assert "no secret named NOPE" in str(missing.json()["error"]["details"]["secrets"])
    made = client.post(
        "/api/v1/jobs/", command_spec(team, secrets=["WANDB_API_KEY"]), format="json"
    )
    assert made.status_code == 201, made.content
    assert VALUE not in made.content.decode()


def test_mask_hides_every_value_in_a_log_line():
    line = f"export WANDB_API_KEY={VALUE}; curl -H 'Authorization: {VALUE}'"
    assert mask(line, [VALUE]) == f"export WANDB_API_KEY={MASK}; curl -H 'Authorization: {MASK}'"
