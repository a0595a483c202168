"""The Fleet page and its CSV export."""

import csv
import io
import re

import pytest

from apps.fleet.models import Gpu, Node
from tests import factories
from tests.apps.fleet.test_services import ready_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def logged_in(client, viewer):
    client.force_login(viewer)
    return client


def build_fleet(racks: int, nodes_per_rack: int):
    site = factories.make_site()
    pool = factories.make_owned_pool(site=site)
    for _ in range(racks):
        rack = factories.make_rack(site=site)
        for unit in range(nodes_per_rack):
            ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4)


def test_the_fleet_page_needs_a_login(client):
    response = client.get("/fleet/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_the_fleet_page_lists_sites_racks_and_nodes(logged_in):
    rack = factories.make_rack(name="Z9")
    node = ready_node(rack=rack, rack_unit=3, name="z9-n1")
    html = logged_in.get("/fleet/").content.decode()
    assert rack.site.name in html
    assert "Z9" in html
    assert f'data-node="{node.name}"' in html


def test_a_rack_elevation_places_nodes_in_their_units_and_stacks_the_unplaced(logged_in):
    rack = factories.make_rack(name="E1")
    placed = ready_node(rack=rack, rack_unit=5, name="e1-placed", gpu_count=1)
    ready_node(rack=rack, rack_unit=None, name="e1-loose-a")
    ready_node(rack=rack, rack_unit=None, name="e1-loose-b-with-a-very-long-name")
    Gpu.objects.create(node=placed, index=0, health="degraded", health_reason="ECC <errors>")
    # What is drawn, not how the markup is indented.
    html = re.sub(r">\s+<", "><", logged_in.get("/fleet/").content.decode())
    assert (
        '<g class="unit state-ready" transform="translate(0 -70)">'
        "<title>e1-placed · Ready · 1 GPU</title>"
    ) in html
    assert (
        '<g class="unit unplaced state-ready" transform="translate(0 -14)">'
        "<title>e1-loose-a · Ready · "
    ) in html
    assert '<g class="unit unplaced state-ready" transform="translate(0 -28)">' in html
    assert f'<a href="/fleet/nodes/{placed.pk}/"><text x="6" y="10">e1-placed</text></a>' in html
    assert "e1-loose-b-with-a-very-…</text>" in html
    # Unplaced nodes are drawn first, so that placed ones stay on top.
    assert html.index("e1-loose-a · Ready") < html.index("e1-placed · Ready")
    assert (
        '<span class="gpu health-degraded" title="GPU 0 · Degraded: ECC &lt;errors&gt;"></span>'
    ) in html


def test_the_fleet_page_makes_the_same_queries_for_a_small_or_large_fleet(
    logged_in, django_assert_max_num_queries
):
    build_fleet(racks=1, nodes_per_rack=2)
    with django_assert_max_num_queries(23) as small:
        logged_in.get("/fleet/")
    build_fleet(racks=3, nodes_per_rack=6)
    with django_assert_max_num_queries(len(small.captured_queries)):
        assert logged_in.get("/fleet/").status_code == 200


def test_the_fleet_page_draws_a_bounded_part_of_a_large_fleet(logged_in, monkeypatch):
    from apps.fleet import selectors, views

    monkeypatch.setattr(selectors, "RACKS_SHOWN", 2)
    monkeypatch.setattr(views, "NODES_PAGE_SIZE", 4)
    build_fleet(racks=3, nodes_per_rack=3)
    html = logged_in.get("/fleet/").content.decode()
    assert html.count('class="card rack"') == 2
    assert "the first 2 of 3 racks" in html
    table = html[html.index('id="nodes-table"') :]
    assert table.count("<tr data-node=") == 4 and "Page 1 of 3" in table
    last = logged_in.get("/fleet/?page=3").content.decode()
    assert last[last.index('id="nodes-table"') :].count("<tr data-node=") == 1
    # A filter draws the racks that hold what it matches.
    rack = Node.objects.exclude(rack=None).order_by("-rack__name").first().rack
    narrowed = logged_in.get(f"/fleet/?rack={rack.name}").content.decode()
    assert narrowed.count('class="card rack"') == 1 and f'id="rack-{rack.pk}"' in narrowed


def test_csv_export_follows_the_filters_and_defuses_formulas(logged_in):
    pool = factories.make_owned_pool(slug="csvpool")
    ready_node(pool=pool, name="keep-me")
    factories.make_node(pool=pool, name="=cmd")  # REQUESTED, filtered out below
    response = logged_in.get("/fleet/nodes.csv?state=ready")
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [row["name"] for row in rows] == ["keep-me"]
    everything = logged_in.get("/fleet/nodes.csv").content.decode()
    assert "'=cmd" in everything


def test_the_fleet_page_shows_tenancy_and_job_isolation(logged_in):
    shared = factories.make_owned_pool(slug="shared-pool", tenancy="shared")
    node = ready_node(pool=shared, name="isolated")
    Node.objects.filter(pk=node.pk).update(job_isolation="user")
    ready_node(name="unreported")
    html = logged_in.get("/fleet/").content.decode()
    pools = html[html.index('id="pools"') : html.index('id="nodes"')]
    assert 'title="Teams may share a node; their jobs run as separate users"' in pools
    assert 'title="One team per node at a time"' in pools
    assert "a user per job" in html and "not reported" in html
    rows = list(csv.DictReader(io.StringIO(logged_in.get("/fleet/nodes.csv").content.decode())))
    assert {row["name"]: row["job_isolation"] for row in rows} == {
        "isolated": "user",
        "unreported": "",
    }
