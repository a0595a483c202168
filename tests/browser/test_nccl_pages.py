"""In Chromium: a researcher pastes a blog's NCCL block and gets verdicts in place (htmx);
ops edit a profile and see the linter judge it as they type, before saving."""

import re

import pytest
from playwright.sync_api import expect

from apps.tuning import services
from apps.tuning.models import NcclProfile

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

BLOG_BLOCK = """\
# Use NVLink for intra-node, InfiniBand for inter-node
os.environ["NCCL_NET"] = "IB"
os.environ["NCCL_IB_DISABLE_CUDA_VGRAPH"] = "1"
os.environ["NCCL_PROTO"] = "Simple"
os.environ["NCCL_LAUNCH_MODE"] = "PARALLEL"
"""


def test_paste_a_block_and_read_the_verdicts(page, browser_login, researcher):
    base = browser_login(page, researcher)
    page.get_by_role("link", name="NCCL lint").click()
    expect(page).to_have_url(re.compile(r"/nccl/lint/$"))
    expect(page.locator("h1")).to_have_text("NCCL lint")

    page.fill("#id_text", BLOG_BLOCK)
    page.select_option("#id_fabric", value="efa")
    page.get_by_role("button", name="Lint").click()

    rows = page.locator("#lint-results tr[data-variable]")
    expect(rows).to_have_count(4)
    invented = page.locator('#lint-results tr[data-variable="NCCL_IB_DISABLE_CUDA_VGRAPH"]')
    expect(invented).to_have_attribute("data-level", "error")
    expect(invented).to_contain_text("did you mean NCCL_NET_GDR_LEVEL or NCCL_IB_DISABLE?")
    expect(page.locator('#lint-results tr[data-variable="NCCL_NET"]')).to_contain_text(
        "not the network of efa nodes"
    )
    expect(page.locator('#lint-results tr[data-variable="NCCL_LAUNCH_MODE"]')).to_have_attribute(
        "data-level", "warning"
    )
    expect(page.locator(".lint-counts")).to_contain_text("3 errors")
    # htmx answered in place: still the same page, the block still in the box
    assert page.url == f"{base}/nccl/lint/"
    expect(page.locator("#id_text")).to_have_value(BLOG_BLOCK)


def test_ops_see_the_lint_as_they_type_and_save_a_profile(page, browser_login, ops_user):
    if not NcclProfile.objects.filter(name="ib-lab").exists():
        services.nccl_profile_create(
            by=ops_user,
            name="ib-lab",
            title="Lab rack",
            fabric="infiniband",
            min_nccl_version="2.21",
            env={"NCCL_IB_TIMEOUT": "22"},
        )
    base = browser_login(page, ops_user)
    page.goto(f"{base}/nccl/profiles/ib-lab/")
    page.get_by_role("link", name="Edit").click()
    expect(page.locator("h1")).to_have_text("Edit ib-lab")

    page.fill("#id_env", "NCCL_IB_TIMEOUT=60\nNCCL_ALGO=Tree\n")
    timeout = page.locator('#lint-results tr[data-variable="NCCL_IB_TIMEOUT"]')
    expect(timeout).to_have_attribute("data-level", "error")
    expect(timeout).to_contain_text("outside 1..31")
    expect(page.locator('#lint-results tr[data-variable="NCCL_ALGO"]')).to_have_attribute(
        "data-level", "warning"
    )

    page.fill("#id_env", "NCCL_IB_TIMEOUT=23\nNCCL_ALGO=Tree\n")
    page.fill("#id_reasons", "NCCL_ALGO: Ring hangs on the lab rack's old switch\n")
    expect(timeout).to_have_attribute("data-level", "ok")
    expect(page.locator('#lint-results tr[data-variable="NCCL_ALGO"] .badge')).to_have_text("kept")

    page.get_by_role("button", name="Save").click()
    expect(page).to_have_url(re.compile(r"/nccl/profiles/ib-lab/$"))
    expect(page.locator(".messages")).to_contain_text("Profile ib-lab saved.")
    profile = NcclProfile.objects.get(name="ib-lab")
    assert profile.env == {"NCCL_IB_TIMEOUT": "23", "NCCL_ALGO": "Tree"}
