"""Cloud pools' launch settings through the API and the admin, and the control-plane id."""

import hashlib
import hmac
import os

import pytest

from apps.accounts.models import AuditEvent
from apps.fleet.models import NodePool, OrphanInstance
from tests import factories

pytestmark = pytest.mark.django_db

CLOUD_SETTINGS = {
    "image_id": "ami-0a1b2c3d4e5f60718",
    "subnet_id": "subnet-0123abcd",
    "security_group_ids": ["sg-0123456789abcdef0", "sg-89abcdef"],
    "key_name": "ops key 2026",
    "instance_profile": "arn:aws:iam::123456789012:instance-profile/gpu-nodes",
    "orphans": "terminate",
    "spot_interruption_limit": 0.1,
}


def cloud_pool_body(**extra) -> dict:
    return {
        "name": "AWS us-west-2 p5",
        "slug": "aws-usw2-p5",
        "kind": "cloud",
        "gpu_type": "H100",
        "region": "us-west-2",
        "max_nodes": 4,
        "instance_types": [factories.instance_type("p5.48xlarge").pk],
        **extra,
    }


def test_ops_set_a_cloud_pools_launch_settings(ops_user, api_for):
    client = api_for(ops_user)

    made = client.post("/api/v1/pools/", cloud_pool_body(**CLOUD_SETTINGS), format="json")

    assert made.status_code == 201, made.content
    assert {name: made.json()[name] for name in CLOUD_SETTINGS} == CLOUD_SETTINGS
    pool = NodePool.objects.get(slug="aws-usw2-p5")
    assert pool.security_group_ids == CLOUD_SETTINGS["security_group_ids"]
    changed = client.patch(
        f"/api/v1/pools/{pool.pk}/",
        {"image_id": "ami-89abcdef", "orphans": "report"},
        format="json",
    )
    assert changed.status_code == 200, changed.content
    audit = AuditEvent.objects.filter(action="pool.update").get()
    assert (audit.before["image_id"], audit.after["image_id"]) == (
        CLOUD_SETTINGS["image_id"],
        "ami-89abcdef",
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("image_id", "ami-123"),
        ("image_id", "ami-0a1b2c3d\nami-89abcdef"),
        ("subnet_id", "sn-0123abcd"),
        ("security_group_ids", ["sg-0123abcd", "sg-0123abcd"]),
        ("security_group_ids", ["default"]),
        ("security_group_ids", "sg-0123abcd"),
        ("instance_profile", "arn:aws:iam::12:role/x"),
        ("key_name", "naïve"),
    ],
)
def test_bad_launch_settings_are_refused_by_name(field, value, ops_user, api_for):
    response = api_for(ops_user).post(
        "/api/v1/pools/", cloud_pool_body(**{field: value}), format="json"
    )
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["details"]
    assert not NodePool.objects.filter(slug="aws-usw2-p5").exists()


def test_an_owned_pool_has_no_launch_settings(ops_user, api_for):
    site = factories.make_site()
    response = api_for(ops_user).post(
        "/api/v1/pools/",
        {
            "name": "owned",
            "slug": "owned",
            "kind": "owned",
            "gpu_type": "H100",
            "site": site.pk,
            "image_id": "ami-0123abcd",
        },
        format="json",
    )
    assert response.status_code == 400
    assert "image_id" in response.json()["error"]["details"]


@pytest.mark.parametrize("role", ["admin", "researcher", "finance"])
def test_only_ops_change_launch_settings(role, user_for_role, api_for):
    pool = factories.make_owned_pool()
    cloud = NodePool.objects.create(
        name="c", slug="c", kind="cloud", gpu_type="H100", region="us-east-1"
    )
    client = api_for(user_for_role(role))
    response = client.patch(
        f"/api/v1/pools/{cloud.pk}/", {"image_id": "ami-0123abcd"}, format="json"
    )
    assert response.status_code == 403
    cloud.refresh_from_db()
    assert cloud.image_id == "" and pool.image_id == ""


def test_everyone_reads_the_orphans_the_sweep_found(viewer, api_for):
    from django.utils import timezone

    now = timezone.now()
    OrphanInstance.objects.create(
        instance_id="i-0123456789abcdef0",
        region="us-east-1",
        instance_state="running",
        action="reported",
        first_seen_at=now,
        last_seen_at=now,
    )
    client = api_for(viewer, scopes=("read",))
    listed = client.get("/api/v1/orphan-instances/?action=reported")
    assert listed.status_code == 200
    assert [o["instance_id"] for o in listed.json()["results"]] == ["i-0123456789abcdef0"]
    assert client.post("/api/v1/orphan-instances/", {}, format="json").status_code in (403, 405)


def test_the_admin_shows_a_pools_launch_settings_and_orphans(superuser, client):
    client.force_login(superuser)
    pool = NodePool.objects.create(
        name="c", slug="c", kind="cloud", gpu_type="H100", region="us-east-1"
    )
    page = client.get(f"/admin/fleet/nodepool/{pool.pk}/change/")
    assert page.status_code == 200
    for name in ("image_id", "subnet_id", "security_group_ids", "key_name", "instance_profile"):
        assert f'name="{name}"' in page.content.decode()
    assert client.get("/admin/fleet/orphaninstance/").status_code == 200


def test_the_control_plane_id_is_derived_from_the_secret_key_unless_set(settings):
    if os.environ.get("CONTROLPLANE_ID"):
        pytest.skip("CONTROLPLANE_ID is set in this environment")
    derived = hmac.new(settings.SECRET_KEY.encode(), b"controlplane-id", hashlib.sha256)
    expected = "cp-" + derived.hexdigest()[:12]
    assert expected == settings.CONTROLPLANE_ID
