"""A researcher ticks finished jobs on the History page and compares them: their loss and
tokens/s curves overlaid, each job in its own colour, under the page's policy."""

import re

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.jobs import services
from apps.jobs.models import Job, JobState, StepMetric
from tests.apps.jobs.conftest import command_spec
from tests.browser.test_submit_page import fleet  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _finished_with_steps(team, user, name: str, losses: list[float]) -> Job:
    job, _ = services.job_submit(team=team, spec=command_spec(team, name=name), submitted_by=user)
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, finished_at=now)
    StepMetric.objects.bulk_create(
        StepMetric(job=job, attempt=1, step=s + 1, at=now, loss=loss, tokens_per_s=900.0 + s)
        for s, loss in enumerate(losses)
    )
    return job


def test_ticked_jobs_are_compared_on_one_chart(page, browser_login, fleet, team, researcher):  # noqa: F811
    reported = []
    page.on("console", lambda message: reported.append(message.text))
    fast = _finished_with_steps(team, researcher, "lr-3e-4", [4.0, 3.0, 2.5, 2.2])
    slow = _finished_with_steps(team, researcher, "lr-1e-4", [4.0, 3.6, 3.3, 3.1, 3.0])
    _finished_with_steps(team, researcher, "not-ticked", [5.0])

    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/history/")
    page.check(f'#history-table tr[data-job="{fast.pk}"] input[type=checkbox]')
    page.check(f'#history-table tr[data-job="{slow.pk}"] input[type=checkbox]')
    page.click("#compare-button")

    expect(page).to_have_url(re.compile(r"/jobs/compare/\?job=\d+&job=\d+$"))
    assert {int(i) for i in re.findall(r"job=(\d+)", page.url)} == {fast.pk, slow.pk}
    expect(page.locator("h1")).to_have_text("Jobs compared")
    rows = page.locator("#compare-table tbody tr")
    expect(rows).to_have_count(2)
    fast_row = page.locator(f'#compare-table tr[data-job="{fast.pk}"]')
    expect(fast_row).to_contain_text("lr-3e-4")
    expect(fast_row).to_contain_text("2.2000")  # its last loss
    slow_row = page.locator(f'#compare-table tr[data-job="{slow.pk}"]')
    expect(slow_row.locator("td.num").first).to_have_text("5")  # its steps
    expect(page.locator("#compare-table")).not_to_contain_text("not-ticked")
    charts = page.locator("#compare-charts svg.chart")
    expect(charts).to_have_count(2)
    for chart in (charts.nth(0), charts.nth(1)):
        curves = chart.locator("polyline")
        expect(curves).to_have_count(2)
        # Each job its own colour, the same as its swatch in the table.
        colours = curves.evaluate_all("lines => lines.map(line => line.getAttribute('stroke'))")
        swatches = rows.locator(".swatch rect").evaluate_all(
            "rects => rects.map(rect => rect.getAttribute('fill'))"
        )
        assert colours == swatches and len(set(colours)) == 2
    expect(charts.nth(0)).to_have_attribute("aria-label", "Loss")
    expect(charts.nth(1)).to_have_attribute("aria-label", "Tokens per second")
    # The curves' titles name the jobs (a reader hovering over a line).
    titles = charts.nth(0).locator("polyline title").all_text_contents()
    assert sorted(titles) == sorted([f"#{fast.pk} lr-3e-4", f"#{slow.pk} lr-1e-4"])

    page.click("text=← History")
    expect(page.locator("h1")).to_have_text("History")
    assert not [text for text in reported if "Content Security Policy" in text]
