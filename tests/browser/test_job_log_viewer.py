"""A researcher reads a running job's output on its page in headless Chromium: new lines are
followed while the viewer is at the bottom and left alone once they scroll up; node rank,
attempt and search filters; the whole log downloaded."""

import datetime as dt

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from apps.fleet.models import Node
from apps.jobs import services
from apps.jobs.dispatch import run_logs_append
from apps.jobs.models import Run
from tests.apps.jobs.conftest import command_spec
from tests.browser.test_submit_page import fleet  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _append(run: Run, texts: list[str], *, first_seq: int) -> None:
    at = timezone.now().timestamp()
    run_logs_append(
        node_id=run.node_id,
        run_id=run.pk,
        lines=[
            {"seq": first_seq + i, "stream": "stdout", "at": at + i / 1000, "text": text}
            for i, text in enumerate(texts)
        ],
    )


@pytest.fixture
def running_job(fleet, team, researcher):  # noqa: F811
    """A two-node command job whose attempt 1 ran on ranks 0 and 1 and attempt 2 runs now."""
    spec = command_spec(team, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
    nodes = list(Node.objects.filter(pool=fleet).order_by("name")[:2])
    runs = {}
    for attempt, rank in ((1, 0), (1, 1), (2, 0)):
        runs[attempt, rank] = Run.objects.create(
            job=job,
            node=nodes[rank],
            attempt=attempt,
            node_rank=rank,
            plan={"argv": ["x"]},
            ended_at=timezone.now() - dt.timedelta(minutes=1) if attempt == 1 else None,
        )
    _append(runs[1, 0], [f"first try rank 0 line {i}" for i in range(5)], first_seq=0)
    _append(runs[1, 1], ["first try rank 1 hello", "rank 1 found the NEEDLE"], first_seq=0)
    _append(runs[2, 0], [f"step {i} loss 2.5" for i in range(150)], first_seq=0)
    return job, runs


def _choose(page, select: str, value: str) -> None:
    """Choose a filter once htmx has settled the last swap (a new viewer takes events only
    once htmx has processed it: a person never beats it, a test may)."""
    page.wait_for_function("() => !document.querySelector('.htmx-settling, .htmx-swapping')")
    page.select_option(select, value=value)


def _at_bottom(viewer) -> bool:
    return viewer.evaluate("pre => pre.scrollHeight - pre.scrollTop - pre.clientHeight <= 8")


def test_the_log_viewer_follows_unless_scrolled_up_filters_and_downloads(
    page, browser_login, researcher, running_job
):
    job, runs = running_job
    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/{job.pk}/")
    viewer = page.locator("#log-lines")
    lines = viewer.locator(".log-line")
    expect(lines).to_have_count(157)
    expect(lines.last).to_contain_text("step 149 loss 2.5")
    assert viewer.evaluate("pre => pre.scrollHeight > pre.clientHeight")  # it scrolls
    assert _at_bottom(viewer)  # opened at the newest line

    # At the bottom: new lines are appended and followed.
    _append(runs[2, 0], ["step 150 loss 2.4", "step 151 loss 2.3"], first_seq=150)
    expect(lines.last).to_contain_text("step 151 loss 2.3", timeout=10_000)
    expect(lines).to_have_count(159)
    page.wait_for_timeout(300)
    assert _at_bottom(viewer)

    # Scrolled up: new lines still come, but the reader's place is kept.
    viewer.evaluate("pre => { pre.scrollTop = 40; }")
    page.wait_for_timeout(200)
    _append(runs[2, 0], ["step 152 loss 2.2"], first_seq=152)
    expect(lines.last).to_contain_text("step 152 loss 2.2", timeout=10_000)
    page.wait_for_timeout(3500)  # another poll or so: nothing jumps
    assert viewer.evaluate("pre => pre.scrollTop") == 40
    assert lines.first.text_content().endswith("first try rank 0 line 0")  # nothing replaced
    # Back at the bottom: followed again.
    viewer.evaluate("pre => { pre.scrollTop = pre.scrollHeight; }")
    _append(runs[2, 0], ["step 153 loss 2.1"], first_seq=153)
    expect(lines.last).to_contain_text("step 153 loss 2.1", timeout=10_000)
    page.wait_for_timeout(300)
    assert _at_bottom(viewer)

    # Node rank 1: only its lines, and those that come later.
    _choose(page, "#log-rank", "1")
    expect(lines).to_have_count(2)
    expect(lines.first).to_contain_text("first try rank 1 hello")
    # Attempt 1 of every rank, then a search (any case) across them.
    _choose(page, "#log-rank", "")
    expect(lines).to_have_count(161)  # the viewer is swapped before the next choice
    _choose(page, "#log-attempt", "1")
    expect(lines).to_have_count(7)
    page.wait_for_function("() => !document.querySelector('.htmx-settling, .htmx-swapping')")
    page.fill("#log-search", "needle")
    expect(lines).to_have_count(1)
    expect(lines.first).to_contain_text("rank 1 found the NEEDLE")
    expect(page.locator("#log-search")).to_have_value("needle")  # kept through the swap
    # A new matching line of the running attempt is not in attempt 1: not shown.
    _choose(page, "#log-attempt", "2")
    expect(page.locator(".log-empty")).to_be_visible()
    _append(runs[2, 0], ["a needle in attempt 2"], first_seq=154)
    expect(lines).to_have_count(1, timeout=10_000)
    expect(lines.first).to_contain_text("a needle in attempt 2")

    # The whole log, every line of every attempt, whatever the filters.
    with page.expect_download() as download:
        page.click("#log-download")
    text = open(download.value.path(), encoding="utf-8").read()  # noqa: SIM115
    assert download.value.suggested_filename == f"job-{job.pk}.log"
    assert len(text.splitlines()) == 5 + 2 + 155
    assert "[attempt 1 rank 1] rank 1 found the NEEDLE" in text
    assert text.splitlines()[-1].endswith("[attempt 2 rank 0] a needle in attempt 2")
