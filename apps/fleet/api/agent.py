"""The endpoints node agents call, authenticated by node token (`Bearer cpn_...`).

Plain Django views rather than DRF: heartbeats are the busiest endpoint of the
control plane and need none of DRF's negotiation. They answer with the API's
one error shape. The protocol is described in workers/agent/agent.py.

Heartbeats can take a shorter road still: `heartbeat_fast_path` lands a plain,
valid heartbeat in front of Django's middleware and URL resolution, which cost
more than the heartbeat itself (apps/fleet/api/shortroad.py). Anything else (a
missing or unknown token, a body that is not a JSON object, a host Django would
refuse, a failure) is handed to Django, which answers it through the view below,
so the answers and their error shape are the same on both roads.
"""

import functools
import json

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.fleet import agents
from apps.fleet.api.shortroad import Answer, bearer_token, short_road
from controlplane.api import error_body
from controlplane.errors import ApplicationError

MAX_BODY_BYTES = 4 * 1024 * 1024


def _error(status: int, code: str, message: str, details=None) -> JsonResponse:
    return JsonResponse(error_body(code, message, details), status=status)


def _identity(request) -> agents.AgentIdentity | None:
    """The node a `Bearer cpn_...` header stands for, on both roads."""
    raw = bearer_token(request)
    return agents.agent_identity(raw) if raw is not None else None


def agent_endpoint(*methods: str, bootstrap: bool = False):
    """Node-token authentication, a JSON body, the error shape; the view gets the identity.

    A cloud node's bootstrap token (its user data's) opens only the endpoints that say
    `bootstrap=True`: registration, which hands the agent a token of its own.
    """

    def wrap(view):
        @csrf_exempt
        @functools.wraps(view)
        def endpoint(request, *args, **kwargs):
            if request.method not in methods:
                return _error(405, "method_not_allowed", f"Use {' or '.join(methods)}.")
            identity = _identity(request)
            if identity is not None and identity.bootstrap and not bootstrap:
                identity = None
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
                except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
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


@agent_endpoint("POST", bootstrap=True)
def register(request, identity, body):
    return agents.node_agent_register(identity=identity, report=body)


@agent_endpoint("POST")
def heartbeat(request, identity, body):
    agents.node_heartbeat_land(identity=identity, report=body)
    return {"ok": True}


# --- the heartbeats' short road ----------------------------------------------------------------

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
HEARTBEAT_ROUTE = "agent-heartbeat"  # the URL's name: the route label of the request metrics
_OK = json.dumps({"ok": True}).encode()


def heartbeat_fast_path(application):
    """Wrap a WSGI application: plain valid heartbeats are landed in front of it
    (apps/fleet/api/shortroad.py), with the view's answer; the rest go on."""
    return short_road(
        application,
        method="POST",
        path=HEARTBEAT_PATH,
        route=HEARTBEAT_ROUTE,
        road=_land_plain_heartbeat,
    )


def _land_plain_heartbeat(request) -> Answer | None:
    """Land the heartbeat if it is a plain, valid one; None leaves it to the view."""
    identity = _identity(request)
    if identity is None or identity.bootstrap:
        return None  # the view answers 401
    try:
        report = json.loads(request.body or b"{}")
    except (ValueError, RecursionError):
        return None  # the view answers 400
    if not isinstance(report, dict):
        return None  # the view answers 400
    agents.node_heartbeat_land(identity=identity, report=report)
    return Answer(200, _OK)
