"""The admin writes through the services: their rules hold and the audit log sees it."""

import pytest

from apps.accounts.models import AuditEvent
from apps.fleet.models import Node, NodeState
from tests import factories
from tests.apps.fleet.test_services import ready_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(client, superuser):
    client.force_login(superuser)
    return client


def test_the_drain_action_calls_the_service(admin_client):
    node = ready_node()
    response = admin_client.post(
        "/admin/fleet/node/", {"action": "drain", "_selected_action": [node.pk]}, follow=True
    )
    assert response.status_code == 200
    assert Node.objects.get(pk=node.pk).state == NodeState.DRAINED
    event = AuditEvent.objects.get(action="node.drained", object_id=str(node.pk))
    assert event.channel == "admin"


def test_adding_a_node_that_breaks_a_rule_writes_nothing(admin_client):
    pool = factories.make_owned_pool()
    response = admin_client.post(
        "/admin/fleet/node/add/",
        {
            "name": "bad-node",
            "pool": pool.pk,
            "provider": "aws",
            "capacity_type": "spot",
            "gpu_type": pool.gpu_type,
            "gpu_count": 8,
            "ssh_port": 22,
            "gpus-TOTAL_FORMS": 0,
            "gpus-INITIAL_FORMS": 0,
        },
        follow=True,
    )
    assert "Owned pools take local or ssh nodes." in response.content.decode()
    assert not Node.objects.filter(name="bad-node").exists()


def test_adding_a_node_in_the_admin_goes_through_node_create(admin_client):
    pool = factories.make_owned_pool()
    admin_client.post(
        "/admin/fleet/node/add/",
        {
            "name": "good-node",
            "pool": pool.pk,
            "provider": "local",
            "capacity_type": "owned",
            "gpu_type": pool.gpu_type,
            "gpu_count": 8,
            "ssh_port": 22,
            "gpus-TOTAL_FORMS": 0,
            "gpus-INITIAL_FORMS": 0,
        },
    )
    node = Node.objects.get(name="good-node")
    assert node.events.get().reason == "registered"
    assert AuditEvent.objects.get(action="node.create").channel == "admin"


def test_audit_rows_cannot_be_changed_in_the_admin(admin_client):
    factories.make_site()
    event = AuditEvent.objects.first()
    assert admin_client.get(f"/admin/accounts/auditevent/{event.pk}/delete/").status_code == 403
    page = admin_client.get(f"/admin/accounts/auditevent/{event.pk}/change/")
    assert page.status_code == 200 and 'name="_save"' not in page.content.decode()


def test_a_nodes_job_isolation_is_read_only_and_a_pools_tenancy_editable(admin_client):
    node = ready_node()
    page = admin_client.get(f"/admin/fleet/node/{node.pk}/change/").content.decode()
    assert "Job isolation" in page and 'name="job_isolation"' not in page
    page = admin_client.get(f"/admin/fleet/nodepool/{node.pool_id}/change/").content.decode()
    assert 'name="tenancy"' in page
