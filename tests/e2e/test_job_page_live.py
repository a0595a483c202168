"""A researcher submits a command job from the Submit page and keeps its page open until it
succeeds: a real agent runs it, and the page follows every state change and the newest log
line without a reload, then stops asking."""

import re
import time

import pytest
from playwright.sync_api import expect

from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

# One argument a line (the form runs no shell): ticks over a few seconds, then a last line.
TICKER = (
    "import time; [print('tick', i, flush=True) or time.sleep(0.7) for i in range(10)]; "
    "print('the newest line', flush=True)"
)


def test_a_job_page_follows_its_job_from_submit_to_success(
    page, browser_login, local_nodes, e2e_team
):
    pool = factories.make_owned_pool(slug="e2e-live-page")
    local_nodes(pool, count=1, gpus=8)
    researcher = factories.make_member(team=e2e_team, role="researcher")
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    reported = []
    page.on("console", lambda message: reported.append(message.text))

    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/submit/")
    page.fill("#id_name", "followed-live")
    page.select_option("#id_team", value=str(e2e_team.pk))
    page.select_option("#id_kind", value="command")
    page.fill("#id_argv", f"python3\n-c\n{TICKER}")
    page.fill("#id_code_path", "/tmp")
    page.select_option("#id_gpus", value="8")
    page.select_option("#id_placement", value="owned")
    page.get_by_role("button", name="Submit", exact=True).click()
    expect(page).to_have_url(re.compile(r"/jobs/\d+/$"))
    job = Job.objects.get(pk=int(re.search(r"/jobs/(\d+)/$", page.url).group(1)))

    badge = page.locator("#job-state")
    expect(badge).to_have_text("Pending")
    expect(page.locator("#job-reason")).to_contain_text("waiting for the next scheduling pass")
    buttons = page.locator(".job-actions button")
    expect(buttons).to_have_text(["Cancel", "Hold"])
    # Marked now: a reload would lose it.
    page.evaluate("() => { window.keptOpen = true; }")

    scheduling_pass()
    job_dispatch(job_id=job.pk)

    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        text = badge.text_content()
        if not seen or seen[-1] != text:
            seen.append(text)
        if text == "Succeeded":
            break
        page.wait_for_timeout(100)
    assert seen[0] == "Pending" and seen[-1] == "Succeeded", seen
    assert "Running" in seen, seen  # it ran for seconds: the page showed it
    expect(buttons).to_have_count(0)  # a success is not cancelled, held or run again
    expect(page.locator("#job-reason")).to_contain_text("the command exited 0 on its node")
    # Every state change is on the timeline, which came with the head.
    expect(page.locator("#job-timeline li[data-to]")).to_have_count(6)
    states = page.locator("#job-timeline li[data-to]").evaluate_all(
        "items => items.map(item => item.dataset.to)"
    )
    assert states == ["pending", "admitted", "provisioning", "starting", "running", "succeeded"]
    expect(page.locator("#runs-table tbody tr")).to_have_count(1)
    expect(page.locator("#runs-table tbody tr")).to_contain_text("Exited")
    expect(page.locator("#job-nodes")).to_contain_text(job.runs.get().node.name)

    # The output: every tick, then the newest line, appended once each, followed to the end.
    lines = page.locator("#log-lines .log-line")
    expect(lines.last).to_have_text("the newest line", timeout=30_000)
    texts = lines.all_text_contents()
    assert texts == [f"tick {i}" for i in range(10)] + ["the newest line"]
    at_bottom = page.locator("#log-lines").evaluate(
        "pre => pre.scrollHeight - pre.scrollTop - pre.clientHeight <= 8"
    )
    assert at_bottom
    expect(page.locator("#log-poll")).to_contain_text("The job has finished", timeout=30_000)

    assert page.evaluate("() => window.keptOpen") is True  # never reloaded
    assert not [url for url in requests if re.search(rf"/jobs/{job.pk}/$", url)][1:]
    # Finished: the head asks no more.
    asked = len([url for url in requests if "/live/" in url])
    page.wait_for_timeout(4000)
    assert len([url for url in requests if "/live/" in url]) == asked
    assert not [text for text in reported if "Content Security Policy" in text]
