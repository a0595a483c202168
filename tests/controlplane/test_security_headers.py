"""Security headers: a Content-Security-Policy on every page (no inline code, never framed)
and HSTS over HTTPS."""

import re

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

PAGES = [
    "/login/",
    "/fleet/",
    "/jobs/",
    "/jobs/submit/",
    "/jobs/history/",
    "/costs/",
    "/checkpoints/",
    "/nccl/profiles/",
    "/nccl/lint/",
    "/nccl/variables/",
    "/tokens/",
    "/api/docs/",
    "/admin/",
    "/no-such-page/",
]
# Code the policy would refuse: a script without src, an event handler attribute, a style
# attribute or element.
INLINE = re.compile(
    r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>|\son[a-z]+\s*=|\sstyle\s*=|<style",
    re.IGNORECASE,
)


def policy(response) -> dict[str, str]:
    header = response["Content-Security-Policy"]
    return dict(part.strip().partition(" ")[::2] for part in header.split(";"))


@pytest.mark.parametrize("path", PAGES)
def test_every_page_has_a_policy_its_own_markup_keeps(path, superuser):
    client = Client()
    if path != "/login/":
        client.force_login(superuser)
    response = client.get(path)
    assert response.status_code in (200, 404), path
    rules = policy(response)
    assert rules["script-src"] == "'self'" and rules["style-src"] == "'self'"
    assert rules["object-src"] == "'none'" and rules["frame-ancestors"] == "'none'"
    assert rules["base-uri"] == "'self'" and rules["form-action"] == "'self'"
    found = INLINE.findall(response.content.decode())
    assert not found, found


def test_the_api_docs_script_is_a_file_of_this_site(client):
    page = client.get("/api/docs/").content.decode()
    script = re.search(r'<script src="(/api/docs/\?[^"]*script[^"]*)"', page)
    assert script, page
    answer = client.get(script.group(1).replace("&amp;", "&"))
    assert answer.status_code == 200
    assert answer["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in answer.content.decode()


def test_the_server_error_page_keeps_the_policy_too():
    from django.template import loader

    assert not INLINE.findall(loader.get_template("500.html").render())


def test_hsts_is_sent_over_https(client):
    response = client.get("/login/", secure=True)
    assert response["Strict-Transport-Security"].startswith("max-age=31536000")
