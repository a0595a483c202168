"""The admin saves NCCL profiles through the services: the linter and the audit log see it."""

import pytest

from apps.accounts.models import AuditEvent
from apps.tuning.models import NcclProfile

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client, superuser):
    client.force_login(superuser)
    return client


def profile_form(**changes):
    data = {
        "name": "admin-made",
        "title": "Made in the admin",
        "description": "",
        "fabric": "infiniband",
        "min_nccl_version": "",
        "max_nccl_version": "",
        "env": '{"NCCL_IB_TIMEOUT": "22"}',
        "reasons": "{}",
    }
    data.update(changes)
    return data


def test_the_admin_lists_the_profiles(admin_client):
    html = admin_client.get("/admin/tuning/ncclprofile/").content.decode()
    assert "ib-nvswitch-8gpu" in html and "efa-p5" in html
    assert admin_client.get("/admin/tuning/ncclprofile/add/").status_code == 200


def test_a_profile_added_in_the_admin_is_linted_and_audited(admin_client):
    refused = admin_client.post(
        "/admin/tuning/ncclprofile/add/",
        profile_form(env='{"NCCL_IB_DISABLE_DIRECT": "1"}'),
        follow=True,
    )
    assert "does not pass the linter" in refused.content.decode()
    assert not NcclProfile.objects.filter(name="admin-made").exists()

    admin_client.post("/admin/tuning/ncclprofile/add/", profile_form(), follow=True)
    profile = NcclProfile.objects.get(name="admin-made")
    assert profile.env == {"NCCL_IB_TIMEOUT": "22"}
    assert AuditEvent.objects.get(action="nccl_profile.create").channel == "admin"
