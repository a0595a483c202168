"""A person logs in with headless Chromium and sees the fleet."""

import re

import pytest
from playwright.sync_api import expect

from tests import factories
from tests.apps.fleet.test_services import ready_node

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_log_in_and_see_the_fleet_page(page, browser_login, researcher):
    site = factories.make_site(name="Lisbon DC", slug="lis1")
    rack = factories.make_rack(site=site, name="C3")
    pool = factories.make_owned_pool(site=site, slug="lis-h100")
    node = ready_node(pool=pool, rack=rack, rack_unit=5, name="lis-c3-n1")

    base = browser_login(page, researcher)

    expect(page).to_have_url(re.compile(r"/fleet/$"))
    expect(page.locator("h1")).to_have_text("Fleet")
    expect(page.get_by_role("heading", name="Lisbon DC")).to_be_visible()
    row = page.locator(f'#nodes-table tr[data-node="{node.name}"]')
    expect(row).to_contain_text("Ready")
    expect(row).to_contain_text("lis-h100")
    expect(page.locator("svg title", has_text="lis-c3-n1")).to_have_count(1)

    page.get_by_role("button", name="Log out").click()
    page.goto(f"{base}/fleet/")
    expect(page).to_have_url(re.compile(r"/login/\?next=/fleet/"))


def test_a_wrong_password_stays_on_the_login_page(page, live_server, researcher):
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", researcher.username)
    page.fill("#id_password", "not-the-password")
    page.click("button[type=submit]")
    expect(page).to_have_url(re.compile(r"/login/"))
    expect(page.locator("body")).to_contain_text("correct username and password")


def test_the_api_docs_render_without_a_cdn(page, live_server):
    page.goto(f"{live_server.url}/api/docs/")
    expect(page.get_by_text("GPU control plane API")).to_be_visible(timeout=15000)
    expect(page.locator(".opblock-tag", has_text="audit-events")).to_be_visible()
    # Newer Swagger UI builds render only what is near the viewport: scroll to the tag.
    nodes = page.locator(".opblock-tag", has_text=re.compile(r"^nodes$"))
    # Steps shorter than a screen, so no tag passes by between two looks.
    for _ in range(600):
        if nodes.count():
            break
        page.mouse.wheel(0, 400)
        page.wait_for_timeout(50)
    expect(nodes).to_be_visible()
