"""Calling webhooks: the signed request, the retry schedule, and who may be called.

Each call is `POST url` with the job's outcome as JSON and the header
`X-Controlplane-Signature: sha256=<hex HMAC-SHA256 of the body>` under the
webhook's signing key, which the receiver checks. Calls to loopback, private and
link-local addresses are refused unless WEBHOOK_ALLOW_PRIVATE is on (the control
plane must not be a way into its own network).
"""

import datetime as dt
import hashlib
import hmac
import ipaddress
import json
import socket
import urllib.error
import urllib.request
from urllib.parse import urlparse

from django.conf import settings

RETRY_DELAYS_S = [10, 30, 120, 600, 1800, 3600, 3 * 3600, 6 * 3600]


def signature(key: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


def next_attempt(attempts: int, now: dt.datetime) -> dt.datetime | None:
    """When to try again after `attempts` failures, or None to give up."""
    if attempts >= len(RETRY_DELAYS_S):
        return None
    return now + dt.timedelta(seconds=RETRY_DELAYS_S[attempts])


class RefusedAddress(ValueError):
    pass


def check_destination(url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("https", "http"):
        raise RefusedAddress("Webhooks are http(s) URLs.")
    if parsed.scheme == "http" and not settings.WEBHOOK_ALLOW_HTTP:
        raise RefusedAddress("Webhooks must use https.")
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parsed.hostname, None)}
    except (socket.gaierror, UnicodeError):
        raise RefusedAddress(f"Cannot resolve {parsed.hostname}.") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved:
            raise RefusedAddress(f"{parsed.hostname} resolves to a private address ({ip}).")


def send(url: str, key: bytes, payload: dict, *, timeout_s: float = 10.0) -> int:
    """POST the payload; returns the HTTP status, raises OSError on no answer."""
    check_destination(url)
    body = json.dumps(payload, sort_keys=True, default=str).encode()
    request = urllib.request.Request(url, data=body, method="POST")  # noqa: S310 (checked)
    request.add_header("Content-Type", "application/json")
    request.add_header("User-Agent", "gpu-controlplane-webhook/1")
    request.add_header("X-Controlplane-Signature", signature(key, body))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
