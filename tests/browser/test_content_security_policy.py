"""The pages work under their Content-Security-Policy: Chromium reports no violation while
htmx, the charts and Swagger UI do their work."""

import pytest
from playwright.sync_api import expect

from tests.browser.test_submit_page import fleet  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_pages_run_without_a_policy_violation(page, browser_login, fleet, researcher):  # noqa: F811
    reported = []
    page.on("console", lambda message: reported.append(message.text))
    page.on("pageerror", lambda error: reported.append(str(error)))
    base = browser_login(page, researcher)

    page.goto(f"{base}/jobs/submit/")
    page.select_option("#id_gpus", value="8")
    # htmx ran (its script is a file of the site) and swapped the outlook in.
    expect(page.locator("#outlook")).to_contain_text("there is room for it now")
    for path in ("/fleet/", "/jobs/", "/costs/", "/tokens/", "/nccl/lint/"):
        page.goto(f"{base}{path}")
        page.wait_for_load_state("networkidle")
    page.goto(f"{base}/api/docs/")
    expect(page.locator(".opblock-tag", has_text="audit-events")).to_be_visible(timeout=15000)

    violations = [text for text in reported if "Content Security Policy" in text]
    assert not violations, violations

    # And the policy holds: a script written into the page is refused, and reported.
    injected = page.evaluate(
        """() => {
            const script = document.createElement("script");
            script.textContent = "window.injected = true";
            document.head.append(script);
            return window.injected === true;
        }"""
    )
    assert injected is False
    page.wait_for_timeout(200)
    assert [text for text in reported if "Content Security Policy" in text]
