"""Calling webhooks: the signed request, the retry schedule, and who may be called.

Each call is `POST url` with the job's outcome as JSON and the header
`X-Controlplane-Signature: sha256=<hex HMAC-SHA256 of the body>` under the
webhook's signing key, which the receiver checks. Calls to any address that is not
global unicast (loopback, private, link-local such as a cloud's metadata service, shared,
reserved, multicast, or an IPv6 address that leads to such an IPv4 one through NAT64,
6to4 or IPv4 mapping) are refused unless WEBHOOK_ALLOW_PRIVATE is on: the control plane
must not be a way into its own network. So that a check cannot be got round, the call connects
to the very address that was checked (a name that resolves elsewhere a second time,
DNS rebinding, does not move it) and follows no redirect (a 3xx is the call's answer,
a failed one).
"""

import datetime as dt
import functools
import hashlib
import hmac
import http.client
import ipaddress
import json
import re
import socket
from urllib.parse import urlparse, urlsplit, urlunsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator

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


def attempt(url: str, key: bytes, payload: dict) -> tuple[int | None, str]:
    """One call: the HTTP status (None where nothing answered) and what went wrong, for the
    outbox's record (jobs' and budget alerts' webhooks alike)."""
    try:
        return send(url, key, payload), ""
    except (OSError, RefusedAddress, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:300]


def answered(status: int | None) -> bool:
    """The receiver took the call (a 2xx); anything else is tried again later."""
    return status is not None and 200 <= status < 300


# RFC 3986's characters of a path, query or fragment, and of the user information.
_URI_PART = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*")
_USERINFO = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:]|%[0-9A-Fa-f]{2})*")
_http_url = URLValidator(schemes=["http", "https"])


def url_problem(url: str) -> str | None:
    """Why `url` is not an absolute http(s) URL written as an RFC 3986 URI, or None.

    Django's URL check alone lets through what a URI may not hold (non-ASCII text, brackets,
    broken %-escapes): such a URL would be stored and then fail the API's `format: uri`.
    """
    if not url.isascii():
        return "Write the URL in ASCII: other characters %-encoded, host names in punycode."
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises for a port out of range)
        _http_url(url)
    except (ValueError, ValidationError):
        return "Enter an absolute http(s) URL."
    if parts.scheme not in ("http", "https"):
        return "Webhooks are http(s) URLs."
    userinfo = parts.netloc.rpartition("@")[0]
    if not _USERINFO.fullmatch(userinfo) or not all(
        _URI_PART.fullmatch(part) for part in (parts.path, parts.query, parts.fragment)
    ):
        return "Characters a URI does not allow there must be %-encoded."
    return None


def validate_url(url: str) -> None:
    """The model field's validator (apps/jobs' Webhook.url)."""
    problem = url_problem(url)
    if problem is not None:
        raise ValidationError(problem, code="invalid")


def redacted_url(url: str) -> str:
    """The URL with its user information, query and fragment hidden, for those who may see
    where a webhook goes but not the credentials it may carry."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(
        (
            parts.scheme,
            f"***@{host}" if "@" in parts.netloc else host,
            parts.path,
            "***" if parts.query else "",
            "***" if parts.fragment else "",
        )
    )


# Refused whatever Python's ipaddress says of them (it calls some of them global): the
# IETF protocol assignments (DS-Lite, NAT64 discovery, TURN anycast...), the retired 6to4
# relay anycast, local-use NAT64 (which the operator maps to anything, its own network
# included), Teredo, and the retired IPv6 site-local block.
REFUSED_NETWORKS = [
    ipaddress.ip_network(network)
    for network in ("192.0.0.0/24", "192.88.99.0/24", "64:ff9b:1::/48", "2001::/32", "fec0::/10")
]
NAT64 = ipaddress.ip_network("64:ff9b::/96")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address leads to (IPv4-mapped, 6to4, NAT64, IPv4-compatible)."""
    if ip.version == 4:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64 or ip in IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip) -> bool:
    """Global unicast; an address that carries an IPv4 address is as public as that one."""
    if ip.is_multicast or any(ip in net for net in REFUSED_NETWORKS):
        return False
    embedded = _embedded_ipv4(ip)
    if embedded is not None:
        # What it leads to decides, not Python's view of its block, which differs between
        # releases (3.11.2 calls all of 6to4 private, 3.11.7 none of it).
        return is_public(embedded)
    return ip.is_global


def check_destination(url: str) -> str | None:
    """Refuse a URL that is not http(s) or whose host is not a global address. Returns the
    address a call must connect to (the first the name resolved to, all of them checked),
    or None where private addresses are allowed (the name is then resolved as usual)."""
    problem = url_problem(url)
    if problem is not None:
        raise RefusedAddress(problem)
    parsed = urlparse(url)
    if parsed.scheme == "http" and not settings.WEBHOOK_ALLOW_HTTP:
        raise RefusedAddress("Webhooks must use https.")
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return None
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        raise RefusedAddress(f"Cannot resolve {parsed.hostname}.") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not is_public(ip):
            raise RefusedAddress(f"{parsed.hostname} resolves to a private address ({ip}).")
    return addresses[0]  # getaddrinfo answers at least one, or raises


def send(url: str, key: bytes, payload: dict, *, timeout_s: float = 10.0) -> int:
    """POST the payload; returns the HTTP status, raises OSError on no answer."""
    pinned = check_destination(url)
    parsed = urlparse(url)
    body = json.dumps(payload, sort_keys=True, default=str).encode()
    kind = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    # The host name stays the one in the URL: the Host header, TLS's server name and the
    # certificate's check all use it; only the TCP connection goes to the pinned address.
    connection = kind(parsed.hostname, parsed.port, timeout=timeout_s)
    if pinned is not None:
        connection._create_connection = functools.partial(_connect_to, pinned)
    target = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
    try:
        connection.request(
            "POST",
            target,
            body=body,
            headers={
                "Content-Type": "application/json",
                "User-Agent": "gpu-controlplane-webhook/1",
                "X-Controlplane-Signature": signature(key, body),
            },
        )
        return connection.getresponse().status
    except http.client.HTTPException as exc:  # an answer that is not HTTP
        raise OSError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        connection.close()


def _connect_to(address: str, target: tuple, *args, **kwargs) -> socket.socket:
    """socket.create_connection to `address` rather than to the name in `target`."""
    return socket.create_connection((address, target[1]), *args, **kwargs)
