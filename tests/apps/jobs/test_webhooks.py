"""Webhooks: a finished job calls its team's endpoints, signed, retried until delivered."""

import hashlib
import hmac
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apps.jobs import services
from apps.jobs.models import Webhook
from apps.outbox.models import WebhookCall
from apps.outbox.services import calls_send
from controlplane import webhooks
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


@pytest.fixture
def receiver(settings):
    """A real HTTP endpoint on 127.0.0.1 that records calls and answers the next status."""
    settings.WEBHOOK_ALLOW_PRIVATE = True
    settings.WEBHOOK_ALLOW_HTTP = True
    calls = []
    answers = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            calls.append((dict(self.headers), body, self.path))
            answer = answers.pop(0) if answers else 204
            status, headers = answer if isinstance(answer, tuple) else (answer, {})
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_port}/hook", "calls": calls, "answers": answers}
    server.shutdown()


def test_a_cancelled_job_calls_the_team_webhook_signed(
    fleet_pool, quota, team, team_admin, researcher, api_for, receiver
):
    made = api_for(team_admin).post(
        "/api/v1/webhooks/", {"team": team.pk, "url": receiver["url"]}, format="json"
    )
    assert made.status_code == 201, made.content
    key = made.json()["signing_key"]
    assert "signing_key" not in api_for(team_admin).get("/api/v1/webhooks/").content.decode()
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    services.job_cancel(job=job, by=researcher, reason="not needed")
    assert calls_send() == {"delivered": 1, "retrying": 0, "failed": 0}
    headers, body, _ = receiver["calls"][0]
    expected = "sha256=" + hmac.new(key.encode(), body, hashlib.sha256).hexdigest()
    assert headers["X-Controlplane-Signature"] == expected
    payload = json.loads(body)
    assert (payload["job"], payload["state"], payload["reason"]) == (
        job.pk,
        "cancelled",
        "not needed",
    )
    assert WebhookCall.objects.get().state == WebhookCall.State.DELIVERED


def test_a_failing_endpoint_is_retried_with_backoff(
    fleet_pool, quota, team, team_admin, researcher, receiver
):
    services.webhook_create(team=team, url=receiver["url"], by=team_admin)
    receiver["answers"].extend([500])
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    services.job_cancel(job=job, by=researcher)
    assert calls_send()["retrying"] == 1
    delivery = WebhookCall.objects.get()
    assert (delivery.attempts, delivery.last_status) == (1, 500)
    assert calls_send()["delivered"] == 0  # not due yet
    later = delivery.next_attempt_at
    assert calls_send(now=later)["delivered"] == 1
    assert len(receiver["calls"]) == 2


def test_researchers_add_webhooks_only_to_their_own_jobs(
    fleet_pool, quota, team, researcher, api_for, receiver
):
    client = api_for(researcher)
    team_wide = client.post(
        "/api/v1/webhooks/", {"team": team.pk, "url": receiver["url"]}, format="json"
    )
    assert team_wide.status_code == 403
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    own = client.post(
        "/api/v1/webhooks/", {"team": team.pk, "job": job.pk, "url": receiver["url"]}, format="json"
    )
    assert own.status_code == 201, own.content


def test_a_submit_token_neither_adds_nor_removes_webhooks(team, team_admin, api_for, receiver):
    submit = api_for(team_admin, scopes=("submit",))
    made = submit.post(
        "/api/v1/webhooks/", {"team": team.pk, "url": receiver["url"]}, format="json"
    )
    assert made.status_code == 403
    assert not Webhook.objects.exists()
    hook, _ = services.webhook_create(team=team, url=receiver["url"], by=team_admin)
    assert submit.get(f"/api/v1/webhooks/{hook.pk}/").status_code == 200
    assert submit.delete(f"/api/v1/webhooks/{hook.pk}/").status_code == 403
    assert Webhook.objects.filter(pk=hook.pk).exists()
    admin = api_for(team_admin, scopes=("admin",))
    assert admin.delete(f"/api/v1/webhooks/{hook.pk}/").status_code == 204


@pytest.mark.parametrize(
    "url",
    [
        "https://8.8.8.8/é",  # not ASCII: an IRI, not a URI
        "https://exämple.com/hook",  # a name not in punycode
        "ftp://hooks.example/hook",
        "https://hooks.example/a b",
        "https://hooks.example/a[b]",
        "https://hooks.example/%zz",
        "https://hooks.example/hook#a#b",
        "https://hooks.example:99999/hook",
        "https:///hook",
    ],
)
def test_a_webhook_url_is_a_real_absolute_http_url(url, team, team_admin, api_for, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True  # nothing here resolves names
    response = api_for(team_admin).post(
        "/api/v1/webhooks/", {"team": team.pk, "url": url}, format="json"
    )
    assert response.status_code == 400, response.content
    assert "url" in response.json()["error"]["details"]
    assert not Webhook.objects.exists()


def test_only_who_manages_a_webhook_sees_its_credentials(
    team, team_admin, viewer, researcher, ops_user, api_for, settings
):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    url = "https://ci:hunter2@hooks.example/path?token=abc"
    hook, _ = services.webhook_create(team=team, url=url, by=team_admin)
    for user in (team_admin, ops_user):
        assert api_for(user).get(f"/api/v1/webhooks/{hook.pk}/").json()["url"] == url
    for user in (viewer, researcher):
        listed = api_for(user, scopes=("read",)).get("/api/v1/webhooks/").json()["results"]
        assert [row["url"] for row in listed] == ["https://***@hooks.example/path?***"]


def test_private_addresses_are_refused_by_default(team, team_admin, api_for, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    response = api_for(team_admin).post(
        "/api/v1/webhooks/", {"team": team.pk, "url": "https://127.0.0.1/hook"}, format="json"
    )
    assert response.status_code == 400
    assert "private address" in str(response.json()["error"]["details"]["url"])


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data/",  # a cloud's metadata service
        "https://100.64.0.1/hook",  # shared address space (carrier-grade NAT)
        "https://0.0.0.0/hook",
        "https://[::ffff:127.0.0.1]/hook",  # loopback, written as IPv6
        "https://[fd00::1]/hook",
    ],
)
def test_every_address_that_is_not_global_is_refused(url, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(webhooks.RefusedAddress, match="private address"):
        webhooks.check_destination(url)


def test_a_redirect_is_the_answer_and_is_not_followed(
    fleet_pool, quota, team, team_admin, researcher, receiver
):
    services.webhook_create(team=team, url=receiver["url"], by=team_admin)
    elsewhere = receiver["url"].replace("/hook", "/elsewhere")
    receiver["answers"].append((302, {"Location": elsewhere}))
    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    services.job_cancel(job=job, by=researcher)
    assert calls_send()["retrying"] == 1
    assert [path for _, _, path in receiver["calls"]] == ["/hook"]
    assert WebhookCall.objects.get().last_status == 302


def test_the_call_connects_to_the_address_that_was_checked(settings, monkeypatch):
    # DNS rebinding (a name that resolves to a public address for the check, then to a
    # private one for the call) needs a DNS server this test cannot run: the resolver is
    # stood in for, answering a public address first and loopback after.
    settings.WEBHOOK_ALLOW_PRIVATE = False
    public = ("8.8.4.4", 443)
    answers = [public, ("127.0.0.1", 443)]
    resolved, connected = [], []

    def resolver(host, port, *args, **kwargs):
        resolved.append(host)
        address = answers[min(len(resolved), len(answers)) - 1]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", address)]

    def refuse(address, *args, **kwargs):
        connected.append(address)
        raise ConnectionRefusedError("test: nothing is called")

    monkeypatch.setattr(webhooks.socket, "getaddrinfo", resolver)
    monkeypatch.setattr(webhooks.socket, "create_connection", refuse)
    with pytest.raises(OSError):
        webhooks.send("https://rebind.example/hook", b"key", {"job": 1})
    assert resolved == ["rebind.example"]  # resolved once, for the check
    assert connected == [public]


def test_the_retry_schedule_gives_up():
    import datetime as dt

    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    assert webhooks.next_attempt(0, now) == now + dt.timedelta(seconds=10)
    assert webhooks.next_attempt(len(webhooks.RETRY_DELAYS_S), now) is None
