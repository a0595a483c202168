"""The OpenAPI schema a client is generated from: names that do not change when choices
do, descriptions written for its readers, typed items, and a schema that validates."""

import inspect
import json
import re

import pytest
from django.conf import settings
from django.core.management import call_command
from django.test import Client
from inflection import camelize

from apps.jobs.api.serializers import SpecSerializer
from controlplane import api

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def schema(django_db_setup, django_db_blocker) -> dict:
    with django_db_blocker.unblock():
        return json.loads(Client().get("/api/schema/", {"format": "json"}).content)


def enum_fields(schema: dict):
    """(component, property, enum component) for every property whose values are an enum."""
    components = schema["components"]["schemas"]
    for component, body in components.items():
        for name, prop in body.get("properties", {}).items():
            prop = prop.get("items", prop)
            wrapped = [*prop.get("oneOf", []), *prop.get("allOf", [])]
            for ref in [prop.get("$ref"), *(p.get("$ref") for p in wrapped)]:
                if ref and ref.rpartition("/")[2].endswith("Enum"):
                    yield component, name, ref.rpartition("/")[2]


def test_the_schema_generates_without_a_warning_and_validates(tmp_path):
    # --fail-on-warn: an enum name drf-spectacular had to make up (with a hash) warns.
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", tmp_path / "s.yaml")
    assert "JobSubmitRequest" in (tmp_path / "s.yaml").read_text()


def test_enum_names_are_set_or_taken_from_their_field_never_a_hash(schema):
    enums = {n for n in schema["components"]["schemas"] if n.endswith("Enum")}
    assert not [
        n for n in enums if re.search(r"[A-Z][a-z]+[0-9a-f]{3}Enum$", n) and re.search(r"[0-9]", n)
    ]
    # drf-spectacular names an enum after its field, or its component and field; failing
    # both, it adds a hash of the choices (which changes with them) and warns.
    named = set(settings.SPECTACULAR_SETTINGS["ENUM_NAME_OVERRIDES"]) | {"BlankEnum", "NullEnum"}
    for component, field, _ in enum_fields(schema):
        base = component.removesuffix("Request").removeprefix("Patched")
        named |= {f"{camelize(field)}Enum", f"{camelize(base)}{camelize(field)}Enum"}
    assert sorted(enums - named) == []
    for stable in ("JobStateEnum", "JobKindEnum", "JobGpuTypeEnum", "GpuTypeEnum"):
        assert stable in enums
    assert not enums & {"State014Enum", "Kind3d0Enum", "GpuTypeEdaEnum", "ToState014Enum"}


def test_no_component_doubles_its_request_suffix(schema):
    names = schema["components"]["schemas"]
    assert not [n for n in names if n.endswith("RequestRequest")]
    assert "LintRequest" in names


def test_descriptions_are_written_for_users_not_the_codes_own_notes(schema):
    internal = {
        inspect.getdoc(cls)
        for cls in [SpecSerializer, *vars(api).values()]
        if inspect.isclass(cls) and cls.__doc__
    }
    components = schema["components"]["schemas"]
    leaked = sorted(n for n, body in components.items() if body.get("description") in internal)
    assert leaked == []
    described = [
        name
        for name in (
            "JobSubmitRequest",
            "TrainerRequest",
            "CommandRequest",
            "GitSourceRequest",
            "ResourcesRequest",
            "LayoutRequest",
            "PlacementRequest",
            "ModelSizesRequest",
            "PipelineRequest",
            "NcclRequest",
            "Job",
            "JobDetail",
        )
        if components[name].get("description")
    ]
    assert len(described) == 12
    assert "checkpoints (by default only at the end)" in components["TrainerRequest"]["description"]


def test_my_teams_are_typed(schema):
    teams = schema["components"]["schemas"]["Me"]["properties"]["teams"]
    assert teams["items"] == {"$ref": "#/components/schemas/MeTeam"}
    team = schema["components"]["schemas"]["MeTeam"]
    assert set(team["properties"]) == {"id", "slug", "role"}
    assert team["properties"]["role"]["allOf"] == [{"$ref": "#/components/schemas/TeamRoleEnum"}]


def test_my_teams_answer_as_the_schema_says(client, team, researcher):
    client.force_login(researcher)
    answer = client.get("/api/v1/me/").json()
    assert answer["teams"] == [{"id": team.pk, "slug": team.slug, "role": "researcher"}]
