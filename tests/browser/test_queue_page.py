"""A researcher keeps the Queue page open in headless Chromium: a job's state change, its
estimated start and the node it is placed on arrive without a reload, with the page's
filter kept."""

import re

import pytest
from playwright.sync_api import expect

from apps.jobs import services
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import command_spec, fleet_pool, quota  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LIVE = 15_000  # ms: the region asks every 5 s


def test_the_queue_follows_a_job_from_pending_to_placed_without_a_reload(
    page,
    browser_login,
    fleet_pool,  # noqa: F811
    quota,  # noqa: F811
    team,
    researcher,
):
    jobs = [
        services.job_submit(
            team=team, spec=command_spec(team, name=f"run-{n}"), submitted_by=researcher
        )[0]
        for n in range(5)
    ]
    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/?team={team.slug}")
    page.evaluate("window.notReloaded = true")
    first = page.locator(f'#queue-table tr[data-job="{jobs[0].pk}"]')
    fifth = page.locator(f'#queue-table tr[data-job="{jobs[4].pk}"]')
    expect(first.locator(".badge")).to_have_text("Pending")
    expect(fifth.locator(".reason")).to_contain_text("waiting for the next scheduling pass")

    scheduling_pass()  # four jobs fill the four nodes; the fifth waits for one of them

    expect(first.locator(".badge")).to_have_text("Admitted", timeout=LIVE)
    expect(first.locator(".nodes")).to_have_text(re.compile(r"\S"))
    expect(fifth.locator(".badge")).to_have_text("Pending")
    estimate = fifth.locator(".estimate time")
    expect(estimate).to_have_attribute("title", re.compile(r"time limits"))
    expect(page.locator("#queue-count")).to_have_text(re.compile(r"^5 active jobs match"))
    assert page.evaluate("window.notReloaded") is True
    assert page.url.endswith(f"/jobs/?team={team.slug}")

    services.job_cancel(job=jobs[4], by=researcher)

    expect(fifth).to_have_count(0, timeout=LIVE)
    expect(page.locator("#queue-count")).to_have_text(re.compile(r"^4 active jobs match"))
    assert page.evaluate("window.notReloaded") is True
