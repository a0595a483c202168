"""The fleet through the API: everyone reads it, ops change it, bad input changes nothing."""

import pytest

from apps.accounts.models import AuditEvent
from apps.fleet.models import Node, NodePool, NodeState, Rack, Site
from tests import factories
from tests.apps.fleet.test_services import ed25519_key, ready_node

pytestmark = pytest.mark.django_db

LISTS = ["sites", "racks", "instance-types", "pools", "nodes", "node-events", "gpus"]


@pytest.mark.parametrize("kind", LISTS)
def test_every_list_is_paginated_and_readable_by_any_member(kind, viewer, api_for):
    response = api_for(viewer, scopes=("read",)).get(f"/api/v1/{kind}/")
    assert response.status_code == 200
    assert set(response.json()) == {"count", "next", "previous", "results"}


def test_the_instance_type_catalogue_holds_the_published_p5_facts(viewer, api_for):
    rows = {
        row["name"]: row for row in api_for(viewer).get("/api/v1/instance-types/").json()["results"]
    }
    p5 = rows["p5.48xlarge"]
    assert (p5["gpu_type"], p5["gpu_count"], p5["gpu_memory_gib"]) == ("H100", 8, 80)
    assert (p5["vcpus"], p5["memory_gib"], p5["network_gbps"]) == (192, 2048, 3200)
    assert rows["p5e.48xlarge"]["gpu_type"] == rows["p5en.48xlarge"]["gpu_type"] == "H200"
    assert rows["p5en.48xlarge"]["gpu_memory_gib"] == 141
    assert (rows["p4d.24xlarge"]["gpu_type"], rows["p4d.24xlarge"]["gpu_memory_gib"]) == (
        "A100",
        40,
    )


@pytest.mark.parametrize("role", ["finance", "admin", "researcher", "viewer"])
def test_only_ops_change_the_fleet(role, user_for_role, api_for):
    client = api_for(user_for_role(role))
    response = client.post("/api/v1/sites/", {"name": "Oslo", "slug": "osl1"}, format="json")
    assert response.status_code == 403
    assert not Site.objects.filter(slug="osl1").exists()


def test_ops_build_a_rack_of_nodes(ops_user, api_for):
    client = api_for(ops_user)
    site = client.post("/api/v1/sites/", {"name": "Oslo", "slug": "osl1"}, format="json").json()
    rack = client.post(
        "/api/v1/racks/",
        {"site": site["id"], "name": "B4", "power_budget_kw": "42.5", "position": "row B"},
        format="json",
    )
    assert rack.status_code == 201, rack.content
    pool = client.post(
        "/api/v1/pools/",
        {
            "name": "osl H200",
            "slug": "osl-h200",
            "kind": "owned",
            "gpu_type": "H200",
            "site": site["id"],
            "max_nodes": 8,
        },
        format="json",
    )
    assert pool.status_code == 201, pool.content
    node = client.post(
        "/api/v1/nodes/",
        {
            "name": "osl-b4-n1",
            "pool": pool.json()["id"],
            "rack": rack.json()["id"],
            "rack_unit": 3,
            "provider": "ssh",
            "capacity_type": "owned",
            "address": "10.9.0.1",
            "ssh_user": "ops",
            "host_key": ed25519_key(3),
        },
        format="json",
    )
    assert node.status_code == 201, node.content
    body = node.json()
    assert body["state"] == "requested"
    assert body["gpu_type"] == "H200"
    assert body["host_key_fingerprint"].startswith("SHA256:")
    assert AuditEvent.objects.filter(action="node.create", actor=ops_user).count() == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"provider": "aws"}, "provider"),
        ({"capacity_type": "spot"}, "capacity_type"),
        ({"gpu_type": "A100"}, "gpu_type"),
        ({"ssh_port": 70000}, "ssh_port"),
        ({"gpu_count": -1}, "gpu_count"),
        ({"provider": "ssh", "address": ""}, "address"),
        ({"state": "ready"}, "state"),
        ({"name": "bad\x00name"}, "name"),
        ({"host_key": "ssh-rsa notbase64!"}, "host_key"),
    ],
)
def test_a_node_that_does_not_fit_its_pool_is_a_400(change, field, ops_user, api_for):
    pool = factories.make_owned_pool()
    body = {"name": "n1", "pool": pool.pk, "provider": "local", "capacity_type": "owned"}
    body.update(change)
    response = api_for(ops_user).post("/api/v1/nodes/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["details"]
    assert not Node.objects.exists()


def test_a_cloud_pool_needs_a_region_and_matching_instance_types(ops_user, api_for):
    p4d = factories.instance_type("p4d.24xlarge")
    client = api_for(ops_user)
    no_region = client.post(
        "/api/v1/pools/",
        {"name": "c", "slug": "c", "kind": "cloud", "gpu_type": "H100"},
        format="json",
    )
    assert no_region.status_code == 400
    assert "region" in no_region.json()["error"]["details"]
    wrong_gpu = client.post(
        "/api/v1/pools/",
        {
            "name": "c",
            "slug": "c",
            "kind": "cloud",
            "gpu_type": "H100",
            "region": "us-east-1",
            "instance_types": [p4d.pk],
        },
        format="json",
    )
    assert wrong_gpu.status_code == 400
    assert "instance_types" in wrong_gpu.json()["error"]["details"]
    assert not NodePool.objects.filter(slug="c").exists()


def test_a_duplicate_rack_name_in_a_site_is_a_400(ops_user, api_for):
    rack = factories.make_rack(name="A1")
    response = api_for(ops_user).post(
        "/api/v1/racks/",
        {"site": rack.site_id, "name": "A1", "power_budget_kw": "10"},
        format="json",
    )
    assert response.status_code == 400
    assert Rack.objects.filter(site=rack.site, name="A1").count() == 1


def test_a_site_with_racks_cannot_be_deleted(ops_user, api_for):
    rack = factories.make_rack()
    response = api_for(ops_user).delete(f"/api/v1/sites/{rack.site_id}/")
    assert response.status_code == 409
    assert Site.objects.filter(pk=rack.site_id).exists()


def test_drain_and_undrain_through_the_api(ops_user, api_for):
    node = ready_node()
    client = api_for(ops_user)
    missing = client.post(f"/api/v1/nodes/{node.pk}/drain/", {}, format="json")
    assert missing.status_code == 400 and "reason" in missing.json()["error"]["details"]
    drained = client.post(f"/api/v1/nodes/{node.pk}/drain/", {"reason": "fans"}, format="json")
    assert drained.status_code == 200 and drained.json()["state"] == NodeState.DRAINED
    again = client.post(f"/api/v1/nodes/{node.pk}/drain/", {"reason": "fans"}, format="json")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "invalid_transition"
    undrained = client.post(f"/api/v1/nodes/{node.pk}/undrain/", format="json")
    assert undrained.json()["state"] == NodeState.READY


def test_node_state_cannot_be_patched(ops_user, api_for):
    node = ready_node()
    response = api_for(ops_user).patch(
        f"/api/v1/nodes/{node.pk}/", {"state": "down"}, format="json"
    )
    assert response.status_code == 400
    assert Node.objects.get(pk=node.pk).state == NodeState.READY


def test_the_node_list_makes_the_same_queries_for_5_or_50_nodes(
    viewer, api_for, django_assert_max_num_queries
):
    client = api_for(viewer)
    pool = factories.make_owned_pool()
    rack = factories.make_rack()
    for _ in range(5):
        factories.make_node(pool=pool, rack=rack)
    client.get("/api/v1/nodes/")  # warm: the token's last-used write happens once
    with django_assert_max_num_queries(4) as small:
        client.get("/api/v1/nodes/")
    for _ in range(45):
        factories.make_node(pool=pool, rack=rack)
    with django_assert_max_num_queries(len(small.captured_queries)):
        response = client.get("/api/v1/nodes/?page_size=100")
    assert response.json()["count"] == 50


def test_filters_are_validated(viewer, api_for):
    client = api_for(viewer)
    response = client.get("/api/v1/nodes/?state=melting")
    assert response.status_code == 400
    assert "state" in response.json()["error"]["details"]
    huge = client.get("/api/v1/nodes/?pool_id=99999999999999999999999")
    assert huge.status_code == 400 and "pool_id" in huge.json()["error"]["details"]


def test_a_pools_tenancy_is_one_team_per_node_unless_ops_say_shared(ops_user, api_for):
    client = api_for(ops_user)
    pool = factories.make_owned_pool()
    url = f"/api/v1/pools/{pool.pk}/"
    assert client.get(url).json()["tenancy"] == "team"
    bad = client.patch(url, {"tenancy": "anyone"}, format="json")
    assert bad.status_code == 400 and "tenancy" in bad.json()["error"]["details"]
    assert NodePool.objects.get(pk=pool.pk).tenancy == "team"
    shared = client.patch(url, {"tenancy": "shared"}, format="json")
    assert shared.status_code == 200 and shared.json()["tenancy"] == "shared"
    assert AuditEvent.objects.filter(action="pool.update", actor=ops_user).exists()


def test_a_nodes_job_isolation_is_what_its_agent_reports_and_not_writable(ops_user, api_for):
    node = ready_node()
    client = api_for(ops_user)
    assert client.get(f"/api/v1/nodes/{node.pk}/").json()["job_isolation"] == ""
    Node.objects.filter(pk=node.pk).update(job_isolation="none")
    assert client.get(f"/api/v1/nodes/{node.pk}/").json()["job_isolation"] == "none"
    response = client.patch(f"/api/v1/nodes/{node.pk}/", {"job_isolation": "user"}, format="json")
    assert response.status_code == 400
    assert "job_isolation" in response.json()["error"]["details"]
    assert Node.objects.get(pk=node.pk).job_isolation == "none"
