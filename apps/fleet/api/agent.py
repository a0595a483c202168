"""The endpoints node agents call, authenticated by node token (`Bearer cpn_...`).

Plain Django views rather than DRF: heartbeats are the busiest endpoint of the
control plane and need none of DRF's negotiation. They answer with the API's
one error shape. The protocol is described in workers/agent/agent.py.

Heartbeats can take a shorter road still: `heartbeat_fast_path` wraps the WSGI
application (controlplane/wsgi.py) and lands a plain, valid heartbeat without
Django's middleware, URL resolution and request signals, which cost more than
the heartbeat itself (bench/heartbeats.py, bench/RESULTS.md). Sessions, CSRF,
messages and user authentication mean nothing to an agent. Anything else (a
missing or unknown token, a body that is not a JSON object, a host Django would
refuse, a failure) is handed to Django, which answers it through the view below,
so the answers and their error shape are the same on both roads.
"""

import functools
import io
import json
import logging
import time

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.core.handlers.wsgi import WSGIHandler, WSGIRequest
from django.core.signals import request_started
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.fleet import agents
from controlplane.api import error_body
from controlplane.errors import ApplicationError
from controlplane.observability import LATENCY, REQUESTS

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


def _error(status: int, code: str, message: str, details=None) -> JsonResponse:
    return JsonResponse(error_body(code, message, details), status=status)


def _identity(authorization: str) -> agents.AgentIdentity | None:
    scheme, _, raw = authorization.partition(" ")
    return agents.agent_identity(raw.strip()) if scheme.lower() == "bearer" else None


def agent_endpoint(*methods: str):
    """Node-token authentication, a JSON body, the error shape; the view gets the identity."""

    def wrap(view):
        @csrf_exempt
        @functools.wraps(view)
        def endpoint(request, *args, **kwargs):
            if request.method not in methods:
                return _error(405, "method_not_allowed", f"Use {' or '.join(methods)}.")
            # META, not request.headers, which would build a dict of every header first.
            identity = _identity(request.META.get("HTTP_AUTHORIZATION", ""))
            if identity is None:
                response = _error(401, "not_authenticated", "A valid node token is required.")
                response["WWW-Authenticate"] = 'Bearer realm="agent"'
                return response
            body = {}
            if request.method == "POST":
                if len(request.body) > MAX_BODY_BYTES:
                    return _error(413, "too_large", "The body is over 4 MiB.")
                try:
                    body = json.loads(request.body or b"{}")
                except (ValueError, UnicodeDecodeError):
                    return _error(400, "parse_error", "The body is not JSON.")
                if not isinstance(body, dict):
                    return _error(400, "invalid", "The body must be a JSON object.")
            try:
                answer = view(request, identity, body, *args, **kwargs)
            except ApplicationError as exc:
                return _error(exc.status, exc.code, exc.message, exc.details)
            return JsonResponse(answer)

        return endpoint

    return wrap


@agent_endpoint("POST")
def register(request, identity, body):
    return agents.node_agent_register(identity=identity, report=body)


@agent_endpoint("POST")
def heartbeat(request, identity, body):
    agents.node_heartbeat_land(identity=identity, report=body)
    return {"ok": True}


# --- the heartbeats' short road ----------------------------------------------------------------

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
HEARTBEAT_ROUTE = "agent-heartbeat"  # the URL's name: the route label of the request metrics
FAST_BODY_BYTES = 256 * 1024  # a heartbeat is about 2 KiB; anything larger goes the long way
_OK = json.dumps({"ok": True}).encode()
# What the heartbeat view's answer carries once through the middleware (security headers).
_OK_HEADERS = [
    ("Content-Type", "application/json"),
    ("Content-Length", str(len(_OK))),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
]


def heartbeat_fast_path(application):
    """Wrap a WSGI application: plain valid heartbeats are landed here, the rest go on.

    Only POST /api/v1/agent/heartbeat is looked at, and only a request that the
    view would answer 200 is answered here, with the same body and headers, and
    counted in the same request metrics.
    """

    def fast_path(environ, start_response):
        if environ.get("PATH_INFO") == HEARTBEAT_PATH and environ.get("REQUEST_METHOD") == "POST":
            started = time.perf_counter()
            if _land_plain_heartbeat(environ):
                start_response("200 OK", list(_OK_HEADERS))
                REQUESTS.labels("POST", HEARTBEAT_ROUTE, "200").inc()
                LATENCY.labels(HEARTBEAT_ROUTE).observe(time.perf_counter() - started)
                return [_OK]
        return application(environ, start_response)

    return fast_path


def _land_plain_heartbeat(environ) -> bool:
    """Land the heartbeat and return True if it is a plain, valid one. False leaves the
    request to Django (its body, when read, put back for it)."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return False
    if not 0 <= length <= FAST_BODY_BYTES:
        return False
    # What Django does at the start of each request: among its receivers, the one that
    # closes a database connection past its age or broken (a token look-up that misses
    # the cache opens one). Sent, not called, so a test client can disconnect it.
    request_started.send(sender=WSGIHandler, environ=environ)
    try:
        request = WSGIRequest(environ)
        request.get_host()  # the ALLOWED_HOSTS check
        if settings.SECURE_SSL_REDIRECT and not request.is_secure():
            return False  # SecurityMiddleware redirects it
        identity = _identity(environ.get("HTTP_AUTHORIZATION", ""))
        if identity is None:
            return False  # the view answers 401
        raw = request.body
        environ["wsgi.input"] = io.BytesIO(raw)
        try:
            report = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError):
            return False  # the view answers 400
        if not isinstance(report, dict):
            return False  # the view answers 400
        agents.node_heartbeat_land(identity=identity, report=report)
    except DisallowedHost:
        return False  # Django answers 400
    except Exception:
        log.warning("heartbeat short road failed; Django answers instead", exc_info=True)
        return False
    return True
