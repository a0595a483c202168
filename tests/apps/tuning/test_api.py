"""The NCCL API: profiles (everyone reads, ops write), the linter and the catalogue."""

import json

import pytest

from apps.tuning.models import NcclProfile

pytestmark = pytest.mark.django_db

BLOCK = """\
export NCCL_IB_TIMEOUT=60
export NCCL_NET=IB
We also had to increase the NCCL ring buffer size to avoid timeouts:
export NCCL_IB_DISABLE_DIRECT=1
"""


def test_everyone_signed_in_reads_the_profiles_with_their_lint(viewer, api_for):
    response = api_for(viewer, scopes=("read",)).get("/api/v1/nccl-profiles/")
    assert response.status_code == 200
    rows = {row["name"]: row for row in response.json()["results"]}
    assert sorted(rows) == ["efa-p5", "ib-nvswitch-8gpu", "single-node"]
    ib = rows["ib-nvswitch-8gpu"]
    assert ib["fabric"] == "infiniband" and ib["built_in"] and ib["env"]["NCCL_IB_TIMEOUT"] == "22"
    assert {v["level"] for v in ib["lint"]} == {"ok"}


def test_the_profile_list_filters(viewer, api_for):
    client = api_for(viewer, scopes=("read",))
    assert [
        r["name"] for r in client.get("/api/v1/nccl-profiles/?fabric=efa").json()["results"]
    ] == ["efa-p5"]
    assert [
        r["name"] for r in client.get("/api/v1/nccl-profiles/?single_node=true").json()["results"]
    ] == ["single-node"]
    assert client.get("/api/v1/nccl-profiles/?fabric=token-ring").status_code == 400


def test_ops_create_and_edit_and_others_may_not(ops_user, researcher, api_for):
    body = {
        "name": "ib-debug",
        "title": "IB with Ring forced",
        "fabric": "infiniband",
        "env": {"NCCL_ALGO": "Ring", "NCCL_DEBUG": "INFO"},
        "reasons": {"NCCL_ALGO": "bisecting a Tree hang"},
    }
    assert (
        api_for(researcher).post("/api/v1/nccl-profiles/", body, format="json").status_code == 403
    )
    ops = api_for(ops_user)
    created = ops.post("/api/v1/nccl-profiles/", body, format="json")
    assert created.status_code == 201, created.content
    assert [v["level"] for v in created.json()["lint"]] == ["warning", "ok"]
    assert created.json()["lint"][0]["kept_because"] == "bisecting a Tree hang"
    profile_id = created.json()["id"]
    patched = ops.patch(
        f"/api/v1/nccl-profiles/{profile_id}/", {"title": "IB, Ring"}, format="json"
    )
    assert patched.status_code == 200 and patched.json()["updated_by"] == ops_user.username
    assert ops.delete(f"/api/v1/nccl-profiles/{profile_id}/").status_code == 204


def test_a_profile_failing_the_linter_is_a_400_naming_the_variable(ops_user, api_for):
    body = {"name": "bad", "title": "Bad", "env": {"NCCL_IB_TIMEOUT": "60", "NCCL_PROTO": "Simple"}}
    response = api_for(ops_user).post("/api/v1/nccl-profiles/", body, format="json")
    assert response.status_code == 400
    details = response.json()["error"]["details"]
    assert "outside 1..31" in details["env.NCCL_IB_TIMEOUT"][0]
    assert details["env.NCCL_PROTO"][0].endswith("Give reasons.NCCL_PROTO to keep it.")


def test_strict_input_and_the_rules_of_profiles(ops_user, api_for):
    ops = api_for(ops_user)
    unknown = ops.post(
        "/api/v1/nccl-profiles/", {"name": "x", "title": "X", "colour": "red"}, format="json"
    )
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["details"]
    bad_name = ops.post(
        "/api/v1/nccl-profiles/", {"name": "x", "title": "X", "env": {"A B": "1"}}, format="json"
    )
    assert bad_name.status_code == 400 and "env" in bad_name.json()["error"]["details"]
    built_in = NcclProfile.objects.get(name="efa-p5")
    assert ops.delete(f"/api/v1/nccl-profiles/{built_in.pk}/").status_code == 409
    renamed = ops.patch(f"/api/v1/nccl-profiles/{built_in.pk}/", {"name": "efa"}, format="json")
    assert renamed.status_code == 400


def test_lint_a_pasted_block_with_a_read_token(viewer, api_for):
    response = api_for(viewer, scopes=("read",)).post(
        "/api/v1/nccl-lint/", {"text": BLOCK, "fabric": "infiniband"}, format="json"
    )
    assert response.status_code == 200
    body = response.json()
    assert [(v["name"], v["level"]) for v in body["verdicts"]] == [
        ("NCCL_IB_TIMEOUT", "error"),
        ("NCCL_NET", "ok"),
        ("NCCL_IB_DISABLE_DIRECT", "error"),
    ]
    assert body["verdicts"][2]["suggestions"] == ["NCCL_IB_DISABLE", "NCCL_P2P_DIRECT_DISABLE"]
    assert body["counts"] == {"error": 2, "warning": 0, "ok": 1}
    assert body["ignored_lines"] == 1


def test_lint_a_mapping_for_efa_nodes(viewer, api_for):
    response = api_for(viewer, scopes=("read",)).post(
        "/api/v1/nccl-lint/",
        {"env": {"NCCL_PROTO": "simple"}, "fabric": "efa", "nccl_version": "2.21.5"},
        format="json",
    )
    (verdict,) = response.json()["verdicts"]
    assert verdict["level"] == "error" and "on EFA" in verdict["reason"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"text": "NCCL_DEBUG=WARN", "env": {"NCCL_DEBUG": "WARN"}},
        {"text": "NCCL_DEBUG=WARN", "fabric": "token-ring"},
        {"text": "NCCL_DEBUG=WARN", "nccl_version": "two"},
        {"text": "NCCL_DEBUG=WARN", "unknown": 1},
    ],
)
def test_lint_refuses_bad_input(viewer, api_for, body):
    response = api_for(viewer, scopes=("read",)).post("/api/v1/nccl-lint/", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid"


def test_the_catalogue(viewer, api_for, anon_api):
    assert anon_api.get("/api/v1/nccl-variables/").status_code == 401
    rows = api_for(viewer, scopes=("read",)).get("/api/v1/nccl-variables/").json()
    by_name = {row["name"]: row for row in rows}
    assert by_name["NCCL_IB_TIMEOUT"]["maximum"] == 31
    assert by_name["NCCL_ALGO"]["debugging"] is True
    assert by_name["NCCL_ASYNC_ERROR_HANDLING"]["renamed_to"] == "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    assert by_name["FI_PROVIDER"]["family"] == "efa"
    assert "NCCL_IB_DISABLE_CUDA_VGRAPH" not in by_name


@pytest.mark.parametrize("name", ["NCCL_IB_TIMEOUT\n", "NCCL_\ud800"])
def test_a_profiles_variable_names_are_whole_names_and_text(ops_user, api_for, name):
    """ "$" would let a name end in a newline, which the profile's env file would write out."""
    body = json.dumps({"name": "x", "title": "X", "env": {name: "22"}})  # "\ud800" escaped
    response = api_for(ops_user).generic(
        "POST", "/api/v1/nccl-profiles/", body.encode(), "application/json"
    )
    assert response.status_code == 400 and "env" in response.json()["error"]["details"]
    assert not NcclProfile.objects.filter(name="x").exists()
