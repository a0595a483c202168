"""A node's page (state, GPUs and the jobs holding them, telemetry, events), ops' actions on
it, and the Fleet page's heat map of every GPU."""

import datetime as dt

import pytest
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.models import AuditEvent
from apps.fleet import services, telemetry
from apps.fleet.models import Gpu, GpuHealth, GpuMinute, Node, NodeEvent, NodeState
from apps.jobs import services as jobs
from apps.jobs.models import Allocation
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.apps.fleet.test_services import ed25519_key, ready_node
from tests.apps.jobs.conftest import command_spec

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]
S = NodeState


def with_gpus(node, *, utilization=50.0, temperature=60.0):
    Gpu.objects.bulk_create(
        [
            Gpu(
                node=node,
                index=i,
                model="NVIDIA H100 80GB HBM3",
                memory_mib=81920,
                health=GpuHealth.HEALTHY,
                utilization_pct=utilization,
                temperature_c=temperature,
                power_w=400.0,
                memory_used_mib=10240,
                reported_at=timezone.now(),
            )
            for i in range(node.gpu_count)
        ]
    )
    return node


def lisbon_node():
    """lis-c3-n1: READY, 8 GPUs, in rack C3 of site lis1, pool lis-h100."""
    site = factories.make_site(name="Lisbon DC", slug="lis1")
    rack = factories.make_rack(site=site, name="C3")
    pool = factories.make_owned_pool(site=site, slug="lis-h100")
    return with_gpus(ready_node(pool=pool, rack=rack, rack_unit=5, name="lis-c3-n1"))


@pytest.fixture
def rack_node(db):
    return lisbon_node()


def held_by_a_job(team, user, gpus=4):
    """A real job placed by a scheduling pass: it holds `gpus` GPUs of a node."""
    spec = command_spec(team, name="holds-gpus", resources={"gpu_type": "H100", "gpus": gpus})
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=user)
    scheduling_pass()
    allocation = Allocation.objects.get(job=job, ended_at__isnull=True)
    return job, allocation


@pytest.fixture
def quota(team):
    return accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=32, by=None)


def ops_client(client, ops_user):
    client.force_login(ops_user)
    return client


# --- the node page ---------------------------------------------------------------------------


def test_the_node_page_shows_gpus_with_the_job_on_each_and_telemetry(
    client,
    rack_node,
    team,
    researcher,
    quota,
    django_assert_max_num_queries,
):
    job, allocation = held_by_a_job(team, researcher)
    now = timezone.now().replace(microsecond=0)
    telemetry.gpu_samples_record(
        rows=[
            (rack_node.pk, now - dt.timedelta(minutes=m), g, 40 + m, 2048, 55, 300)
            for m in range(1, 6)
            for g in range(8)
        ]
    )
    Node.objects.filter(pk=rack_node.pk).update(agent_version="1.4.0", nccl_version="2.21.5")
    client.force_login(researcher)
    with django_assert_max_num_queries(14):
        response = client.get(f"/fleet/nodes/{rack_node.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    assert "lis-c3-n1" in html and "Lisbon DC / C3 U5" in html
    assert "1.4.0" in html and "2.21.5" in html
    held = set(allocation.slots)
    assert len(held) == 4
    for index in range(8):
        row = html[html.index(f'data-gpu="{index}"') :].split("</tr>")[0]
        if index in held:
            assert f"/jobs/{job.pk}/" in row and "holds-gpus" in row
        else:
            assert "free" in row
    assert html.count('<svg class="chart"') == 4  # utilisation, memory, temperature, power
    assert "GPU utilisation (%) · last hour" in html
    assert 'data-live hx-get="/fleet/nodes/' in html
    assert "Actions" not in html  # a researcher acts on no node


def test_the_node_page_is_found_by_name_and_draws_a_month_from_the_minutes(
    client, rack_node, viewer
):
    now = timezone.now()
    GpuMinute.objects.bulk_create(
        [
            GpuMinute(node=rack_node, at=now - dt.timedelta(days=d), gpu=0, utilization_pct=d)
            for d in (1, 10, 20)
        ]
    )
    client.force_login(viewer)
    html = client.get("/fleet/nodes/lis-c3-n1/?window=30d").content.decode()
    assert "GPU utilisation (%) · last 30 days" in html
    assert "no data yet" in html  # power, memory... were not read in these minutes
    assert client.get("/fleet/nodes/no-such-node/").status_code == 404


def test_another_teams_job_is_not_named_to_a_researcher(
    client,
    rack_node,
    team,
    other_team,
    researcher,
    quota,
):
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    outsider = factories.make_member(team=other_team, role="researcher")
    held_by_a_job(other_team, outsider)
    client.force_login(researcher)
    html = client.get(f"/fleet/nodes/{rack_node.pk}/").content.decode()
    assert "another team's job" in html and "holds-gpus" not in html
    heat = client.get("/fleet/live/").content.decode()
    assert "another team&#x27;s job" in heat and "holds-gpus" not in heat


def test_the_node_live_fragment_polls_until_the_node_is_terminated(client, rack_node, ops_user):
    client.force_login(ops_user)
    fragment = client.get(f"/fleet/nodes/{rack_node.pk}/live/").content.decode()
    assert fragment.startswith("{#") is False and 'id="node-live"' in fragment
    assert "data-live" in fragment and 'hx-trigger="every 5s, live:resume"' in fragment
    services.node_transition(node=rack_node, to=S.TERMINATING, reason="t", by=None)
    services.node_transition(node=rack_node, to=S.TERMINATED, reason="t", by=None)
    fragment = client.get(f"/fleet/nodes/{rack_node.pk}/live/").content.decode()
    assert "data-live" not in fragment and "Terminated" in fragment


# --- actions: ops only -----------------------------------------------------------------------


@pytest.mark.parametrize("role", ["researcher", "viewer", "admin", "finance"])
@pytest.mark.parametrize(
    "action", ["drain", "undrain", "provision", "terminate", "accept-host-key"]
)
def test_only_ops_act_on_a_node(client, rack_node, user_for_role, role, action):
    user = user_for_role(role)
    client.force_login(user)
    page = client.get(f"/fleet/nodes/{rack_node.pk}/").content.decode()
    assert "/drain/" not in page and "Terminate" not in page
    response = client.post(
        f"/fleet/nodes/{rack_node.pk}/{action}/",
        {"reason": "maintenance", "confirm": rack_node.name},
    )
    assert response.status_code == 403
    rack_node.refresh_from_db()
    assert rack_node.state == S.READY
    assert not NodeEvent.objects.filter(node=rack_node, actor=user).exists()


def test_node_actions_need_csrf(rack_node, ops_user):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(ops_user)
    response = client.post(f"/fleet/nodes/{rack_node.pk}/drain/", {"reason": "x"})
    assert response.status_code == 403
    rack_node.refresh_from_db()
    assert rack_node.state == S.READY


def test_ops_drain_and_undrain_from_the_page(client, rack_node, ops_user):
    client = ops_client(client, ops_user)
    page = client.get(f"/fleet/nodes/{rack_node.pk}/").content.decode()
    assert f'action="/fleet/nodes/{rack_node.pk}/drain/"' in page
    assert "csrfmiddlewaretoken" in page

    response = client.post(
        f"/fleet/nodes/{rack_node.pk}/drain/", {"reason": "replacing a fan"}, follow=True
    )
    rack_node.refresh_from_db()
    assert (rack_node.state, rack_node.state_reason) == (S.DRAINED, "replacing a fan")
    assert NodeEvent.objects.filter(node=rack_node, to_state=S.DRAINED, actor=ops_user).exists()
    html = response.content.decode()
    assert "lis-c3-n1 drained" in html  # the message after
    assert f'action="/fleet/nodes/{rack_node.pk}/undrain/"' in html

    client.post(f"/fleet/nodes/{rack_node.pk}/undrain/", follow=True)
    rack_node.refresh_from_db()
    assert rack_node.state == S.READY


def test_a_drain_without_a_reason_says_why_it_was_refused(client, rack_node, ops_user):
    client = ops_client(client, ops_user)
    html = client.post(
        f"/fleet/nodes/{rack_node.pk}/drain/", {"reason": " "}, follow=True
    ).content.decode()
    assert "Say why the node is drained." in html
    rack_node.refresh_from_db()
    assert rack_node.state == S.READY


def test_terminate_asks_for_the_node_name_and_refuses_a_node_with_jobs(
    client,
    rack_node,
    ops_user,
    team,
    researcher,
    quota,
):
    client = ops_client(client, ops_user)
    html = client.post(
        f"/fleet/nodes/{rack_node.pk}/terminate/", {"confirm": "wrong"}, follow=True
    ).content.decode()
    assert "Type the node&#x27;s name" in html
    rack_node.refresh_from_db()
    assert rack_node.state == S.READY

    held_by_a_job(team, researcher)
    rack_node.refresh_from_db()
    assert rack_node.state == S.BUSY
    html = client.post(
        f"/fleet/nodes/{rack_node.pk}/terminate/", {"confirm": rack_node.name}, follow=True
    ).content.decode()
    assert "still runs jobs" in html
    rack_node.refresh_from_db()
    assert rack_node.state == S.BUSY


def test_terminate_an_idle_node(client, ops_user):
    node = with_gpus(ready_node(name="retire-me"))
    client = ops_client(client, ops_user)
    html = client.post(
        f"/fleet/nodes/{node.pk}/terminate/",
        {"confirm": "retire-me", "reason": "end of life"},
        follow=True,
    ).content.decode()
    node.refresh_from_db()
    assert (node.state, node.state_reason) == (S.TERMINATING, "end of life")
    assert "retire-me is terminating." in html
    assert AuditEvent.objects.filter(action="node.terminating", actor=ops_user).exists()


def test_ops_accept_a_host_key_and_provision_from_the_page(client, ops_user):
    node = factories.make_node(name="ssh-1", provider="ssh", address="10.0.0.5")
    node = services.node_transition(node=node, to=S.PROVISIONING, reason="t", by=None)
    node = services.node_host_key_offer(node=node, offered_key=ed25519_key(3))
    client = ops_client(client, ops_user)
    page = client.get(f"/fleet/nodes/{node.pk}/").content.decode()
    fingerprint = page.split("offered, not accepted: <code>")[1].split("</code>")[0]
    assert fingerprint.startswith("SHA256:")

    html = client.post(
        f"/fleet/nodes/{node.pk}/accept-host-key/", {"fingerprint": "SHA256:nope"}, follow=True
    ).content.decode()
    assert "does not match" in html
    client.post(f"/fleet/nodes/{node.pk}/accept-host-key/", {"fingerprint": fingerprint})
    node.refresh_from_db()
    assert (node.state, node.host_key_fingerprint) == (S.BOOTSTRAPPING, fingerprint)

    html = client.post(f"/fleet/nodes/{node.pk}/provision/", follow=True).content.decode()
    assert "ssh-1 will be provisioned" in html
    assert AuditEvent.objects.filter(action="node.provision", actor=ops_user).exists()


def test_an_unknown_action_is_a_404(client, rack_node, ops_user):
    client = ops_client(client, ops_user)
    assert client.post(f"/fleet/nodes/{rack_node.pk}/explode/").status_code == 404
    assert client.get(f"/fleet/nodes/{rack_node.pk}/drain/").status_code == 405


# --- the Fleet page's heat map -----------------------------------------------------------------


def test_the_heat_map_names_the_job_on_each_gpu_and_links_to_its_node(
    client,
    rack_node,
    team,
    researcher,
    quota,
):
    job, allocation = held_by_a_job(team, researcher)
    Gpu.objects.filter(node=rack_node, index=allocation.slots[0]).update(
        utilization_pct=97.0, temperature_c=85.0
    )
    client.force_login(researcher)
    html = client.get("/fleet/").content.decode()
    cells = html.count('<a class="heat-cell ')
    assert cells == 8
    first = allocation.slots[0]
    label = f"lis-c3-n1 GPU {first} · job {job.pk} holds-gpus · 97% busy · 85 °C"
    assert f'aria-label="{label} · 400 W"' in html
    assert f'class="heat-cell heat-10 held" href="/fleet/nodes/{rack_node.pk}/"' in html
    free = next(i for i in range(8) if i not in allocation.slots)
    assert f'aria-label="lis-c3-n1 GPU {free} · free · 50% busy' in html
    by_temperature = client.get("/fleet/?heat=temperature").content.decode()
    assert 'class="heat-cell heat-9 held"' in by_temperature  # 85 °C of 30–90


def test_the_fleet_page_filters_by_pool_site_and_rack_names(client, rack_node, viewer):
    other = with_gpus(ready_node(name="elsewhere"))
    client.force_login(viewer)
    for query in ("pool=lis-h100", "site=lis1", "rack=C3", "site=lis1&rack=C3"):
        html = client.get(f"/fleet/?{query}").content.decode()
        table = html[html.index('id="nodes-table"') :]
        assert 'data-node="lis-c3-n1"' in table and f'data-node="{other.name}"' not in table
        heat = client.get(f"/fleet/live/?{query}").content.decode()
        assert "lis-c3-n1 GPU 0" in heat and f"{other.name} GPU 0" not in heat
    page = client.get("/fleet/").content.decode()
    assert '<select name="pool"' in page and '<option value="lis-h100">' in page
    assert 'name="pool_id"' not in page  # ids stay out of sight, as hidden fields when given
    assert (
        'type="hidden" name="pool_id"'
        in client.get(f"/fleet/?pool_id={rack_node.pool_id}").content.decode()
    )


def test_the_fleet_live_fragment_follows_state_changes(client, rack_node, ops_user):
    client.force_login(ops_user)
    page = client.get("/fleet/?pool=lis-h100").content.decode()
    assert 'id="fleet-live" data-live hx-get="/fleet/live/?pool=lis-h100"' in page
    services.node_drain(node=rack_node, reason="fan", by=ops_user)
    fragment = client.get("/fleet/live/?pool=lis-h100").content.decode()
    assert 'data-state="drained"' in fragment and 'data-state="ready"' not in fragment


def test_the_fleet_page_and_its_fragment_make_a_bounded_number_of_queries(
    client,
    viewer,
    team,
    researcher,
    quota,
    django_assert_max_num_queries,
):
    site = factories.make_site(slug="big")
    pool = factories.make_owned_pool(site=site, slug="big-pool")
    rack = factories.make_rack(site=site)
    for unit in range(3):
        with_gpus(ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4))
    held_by_a_job(team, researcher)
    client.force_login(viewer)
    with django_assert_max_num_queries(22) as small:
        client.get("/fleet/")
    with django_assert_max_num_queries(10) as fragment:
        client.get("/fleet/live/")
    for unit in range(3, 9):
        with_gpus(ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4))
    held_by_a_job(team, researcher)
    with django_assert_max_num_queries(len(small.captured_queries)):
        assert client.get("/fleet/").status_code == 200
    with django_assert_max_num_queries(len(fragment.captured_queries)):
        assert client.get("/fleet/live/").status_code == 200


def test_the_node_page_makes_the_same_queries_with_more_gpus_events_and_samples(
    client, ops_user, django_assert_max_num_queries
):
    node = with_gpus(ready_node(name="q1"))
    client.force_login(ops_user)
    with django_assert_max_num_queries(14) as first:
        client.get("/fleet/nodes/q1/")
    with django_assert_max_num_queries(10) as live:
        client.get("/fleet/nodes/q1/live/")
    services.node_drain(node=node, reason="a", by=ops_user)
    services.node_undrain(node=node, by=ops_user)
    now = timezone.now()
    telemetry.gpu_samples_record(
        rows=[
            (node.pk, now - dt.timedelta(seconds=15 * i), g, 1, 1, 1, 1)
            for i in range(200)
            for g in range(8)
        ]
    )
    with django_assert_max_num_queries(len(first.captured_queries)):
        assert client.get("/fleet/nodes/q1/").status_code == 200
    with django_assert_max_num_queries(len(live.captured_queries)):
        assert client.get("/fleet/nodes/q1/live/").status_code == 200
