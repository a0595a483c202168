"""A researcher opens the Checkpoints page in headless Chromium: the job's newest and verified
checkpoints, storage per team, the overdue filter and the CSV link carrying it, then the Job
page's checkpoint panel, which htmx loads from the registry."""

import datetime as dt
import re

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.checkpoints.models import Checkpoint
from apps.jobs.models import Job
from tests.apps.checkpoints.conftest import running_job  # noqa: F401 (a fixture)
from tests.apps.checkpoints.test_api import _steps, checkpointed  # noqa: F401 (a fixture)
from tests.apps.jobs.conftest import fleet_pool, quota  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_researcher_finds_an_overdue_job_and_its_checkpoints(
    page,
    browser_login,
    researcher,
    team,
    checkpointed,  # noqa: F811
):
    now = timezone.now()
    # Every 10 steps at 6 s a step: one is expected every minute; the newest is 3 minutes old.
    Job.objects.filter(pk=checkpointed.pk).update(started_at=now - dt.timedelta(hours=1))
    Checkpoint.objects.filter(job=checkpointed).update(committed_at=now - dt.timedelta(minutes=3))
    _steps(checkpointed, seconds_per_step=6.0, until=now)

    base = browser_login(page, researcher)
    page.goto(f"{base}/checkpoints/")
    expect(page.locator("h1")).to_have_text("Checkpoints")
    row = page.locator(f'#checkpoint-jobs-table tr[data-job="{checkpointed.pk}"]')
    expect(row).to_contain_text("Verified")
    expect(row.locator("td.num").first).to_have_text("20")
    expect(row.locator(".overdue")).to_have_text("overdue")
    expect(page.locator(f'#storage-table tr[data-team="{team.slug}"]')).to_contain_text("KB")

    page.check("#checkpoint-filters input[name=overdue]")
    page.click("#checkpoint-filters button[type=submit]")
    expect(page).to_have_url(re.compile(r"overdue=true"))
    expect(page.locator("#checkpoint-jobs-table tr[data-job]")).to_have_count(1)
    csv = page.locator("#checkpoint-filters a", has_text="Export CSV")
    expect(csv).to_have_attribute("href", re.compile(r"/checkpoints/.*\.csv\?.*overdue=true"))

    row.locator("a").first.click()
    expect(page).to_have_url(re.compile(rf"/jobs/{checkpointed.pk}/$"))
    panel = page.locator("#job-checkpoints")
    expect(panel.locator("#checkpoint-overdue")).to_contain_text("min ago")
    expect(panel.locator('#checkpoints-table tr[data-step="20"]')).to_contain_text("Verified")
    expect(panel.locator('#checkpoints-table tr[data-step="10"]')).to_be_visible()


def test_the_checkpoints_page_follows_a_new_checkpoint_and_a_job_ending_without_a_reload(
    page,
    browser_login,
    researcher,
    team,
    checkpointed,  # noqa: F811
):
    base = browser_login(page, researcher)
    page.goto(f"{base}/checkpoints/?team_id={team.pk}")
    page.evaluate("window.notReloaded = true")
    row = page.locator(f'#checkpoint-jobs-table tr[data-job="{checkpointed.pk}"]')
    expect(row.locator("td.num").first).to_have_text("20")

    Checkpoint.objects.create(
        job=checkpointed,
        team=team,
        attempt=1,
        step=30,
        manifest_sha256="0" * 64,
        committed_at=timezone.now(),
    )
    Job.objects.filter(pk=checkpointed.pk).update(state="succeeded", finished_at=timezone.now())

    expect(row.locator("td.num").first).to_have_text("30", timeout=25_000)
    expect(row.locator(".badge").first).to_have_text("Succeeded")
    assert page.evaluate("window.notReloaded") is True
    assert page.url.endswith(f"/checkpoints/?team_id={team.pk}")
