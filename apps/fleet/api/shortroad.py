"""Short roads: a few hot API requests answered in front of Django's middleware and URL
resolution, which cost more than the requests themselves (bench/heartbeats.py,
bench/api.py, bench/RESULTS.md).

A short road looks at one method and path, and answers only a request that its view
would answer with success, with the view's own body and headers, counted in the same
request metrics. Anything else (a missing or unknown token, a body the view would
refuse, a host Django would refuse) it hands to Django, which then gives the only
answer, in the API's one error shape. Sessions, CSRF, messages and browser logins mean
nothing to these requests: they carry bearer tokens and JSON bodies.

The road: node heartbeats (apps/fleet/api/agent.py), put in front of Django in
controlplane/wsgi.py.
"""

import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest
from django.core.signals import request_started

from controlplane.observability import LATENCY, REQUESTS

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024  # larger bodies go the long way

# What Django's SecurityMiddleware and XFrameOptionsMiddleware add to every answer.
SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
)


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes  # JSON
    headers: tuple[tuple[str, str], ...] = field(default=())


# A road: the request (its body read) → the answer, or None to hand it to Django.
Road = Callable[[WSGIRequest], Answer | None]


def short_road(application, *, method: str, path: str, route: str, road: Road):
    """Wrap a WSGI application: `method path` requests go to `road` first.

    `route` is the URL's name, the route label of the request metrics.
    """

    def wsgi(environ, start_response):
        if environ.get("PATH_INFO") == path and environ.get("REQUEST_METHOD") == method:
            started = time.perf_counter()
            answer = _take(road, environ)
            if answer is not None:
                start_response(
                    f"{answer.status} {HTTPStatus(answer.status).phrase}",
                    [
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(answer.body))),
                        *answer.headers,
                        *SECURITY_HEADERS,
                    ],
                )
                REQUESTS.labels(method, route, str(answer.status)).inc()
                LATENCY.labels(route).observe(time.perf_counter() - started)
                return [answer.body]
        return application(environ, start_response)

    return wsgi


def _take(road: Road, environ) -> Answer | None:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return None
    if not 0 <= length <= MAX_BODY_BYTES:
        return None
    # What Django does at the start of each request: among its receivers, the one that
    # closes a database connection past its age or broken. Sent, not called, so a test
    # client can disconnect it.
    request_started.send(sender=WSGIHandler, environ=environ)
    try:
        request = WSGIRequest(environ)
        request.get_host()  # the ALLOWED_HOSTS check
        if settings.SECURE_SSL_REDIRECT and not request.is_secure():
            return None  # SecurityMiddleware redirects it
        # Read here and put back, so Django can read it again if the road hands over.
        environ["wsgi.input"] = io.BytesIO(request.body)
        return road(request)
    except DisallowedHost:
        return None  # Django answers 400
    except Exception:
        log.warning("short road %s failed; Django answers instead", road.__name__, exc_info=True)
        return None


def bearer_token(request: WSGIRequest) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    # META, not request.headers, which would build a dict of every header first.
    scheme, _, raw = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    raw = raw.strip()
    if scheme.lower() != "bearer" or not raw or " " in raw:
        return None
    return raw
