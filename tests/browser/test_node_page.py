"""Ops in headless Chromium: the Fleet page's heat map leads to a node's page, where they
drain and undrain it; both pages follow changes without a reload."""

import re

import pytest
from playwright.sync_api import expect

from apps.accounts import services as accounts
from apps.fleet import services
from apps.fleet.models import Node, NodeState
from tests.apps.fleet.test_node_page import held_by_a_job, lisbon_node

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def box(transactional_db):
    return lisbon_node()


def test_ops_follow_a_gpu_to_its_node_and_drain_and_undrain_it(
    page, browser_login, box, ops_user, team, researcher
):
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=32, by=None)
    job, allocation = held_by_a_job(team, researcher, gpus=2)
    base = browser_login(page, ops_user)

    page.goto(f"{base}/fleet/")
    cells = page.locator("#gpus a.heat-cell")
    expect(cells).to_have_count(8)
    held = page.locator("#gpus a.heat-cell.held")
    expect(held).to_have_count(2)
    first = allocation.slots[0]
    cell = page.get_by_role("link", name=re.compile(rf"^lis-c3-n1 GPU {first} · job {job.pk} "))
    expect(cell).to_have_attribute("title", re.compile("holds-gpus"))
    cell.click()

    expect(page).to_have_url(re.compile(rf"/fleet/nodes/{box.pk}/$"))
    expect(page.locator("h1")).to_have_text("lis-c3-n1")
    expect(page.locator(f'#gpus-table tr[data-gpu="{first}"]')).to_contain_text("holds-gpus")
    expect(page.locator("svg.chart")).to_have_count(0)  # no samples kept yet: "no data yet"
    expect(page.locator("#node-live .badge[data-state]")).to_have_text("Busy")

    page.get_by_label("Reason").first.fill("replacing a fan")
    page.get_by_role("button", name="Drain").click()
    expect(page.locator(".messages")).to_contain_text("lis-c3-n1 drained")
    # A busy node drains until its job ends.
    expect(page.locator("#node-live .badge[data-state]")).to_have_text("Draining")
    assert Node.objects.get(pk=box.pk).state == NodeState.DRAINING

    page.get_by_role("button", name="Undrain").click()
    expect(page.locator(".messages")).to_contain_text("back in service")
    expect(page.locator("#node-live .badge[data-state]")).to_have_text("Busy")
    assert Node.objects.get(pk=box.pk).state == NodeState.BUSY


def test_the_node_page_and_the_fleet_page_follow_changes_without_a_reload(
    page, browser_login, box, ops_user
):
    reported = []
    page.on("console", lambda message: reported.append(message.text))
    base = browser_login(page, ops_user)
    page.goto(f"{base}/fleet/nodes/{box.pk}/")
    badge = page.locator("#node-live .badge[data-state]")
    expect(badge).to_have_text("Ready")
    services.node_drain(node=box, reason="cooling fault", by=ops_user)
    expect(badge).to_have_text("Drained", timeout=12000)
    expect(page.locator("#node-events")).to_contain_text("cooling fault")

    page.goto(f"{base}/fleet/?pool=lis-h100")
    expect(page.locator('#fleet-live a.tile[data-state="drained"]')).to_be_visible()
    services.node_undrain(node=box, by=ops_user)
    expect(page.locator('#fleet-live a.tile[data-state="ready"]')).to_be_visible(timeout=12000)
    expect(page.locator('#fleet-live a.tile[data-state="drained"]')).to_have_count(0)
    # The heat map, the charts and the live regions run under the pages' policy.
    assert not [text for text in reported if "Content Security Policy" in text], reported


def test_a_researcher_sees_the_node_page_without_actions(page, browser_login, box, researcher):
    base = browser_login(page, researcher)
    page.goto(f"{base}/fleet/nodes/lis-c3-n1/")
    expect(page.locator("h1")).to_have_text("lis-c3-n1")
    expect(page.get_by_role("button", name="Drain")).to_have_count(0)
    expect(page.get_by_text("Terminate this node")).to_have_count(0)
