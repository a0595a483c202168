"""The endpoints node agents call, authenticated by node token (`Bearer cpn_...`).

Plain Django views rather than DRF: heartbeats are the busiest endpoint of the
control plane and need none of DRF's negotiation. They answer with the API's
one error shape. The protocol is described in workers/agent/agent.py.
"""

import functools
import json

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.fleet import agents
from controlplane.api import error_body
from controlplane.errors import ApplicationError

MAX_BODY_BYTES = 4 * 1024 * 1024


def _error(status: int, code: str, message: str, details=None) -> JsonResponse:
    return JsonResponse(error_body(code, message, details), status=status)


def agent_endpoint(*methods: str):
    """Node-token authentication, a JSON body, the error shape; the view gets the identity."""

    def wrap(view):
        @csrf_exempt
        @functools.wraps(view)
        def endpoint(request, *args, **kwargs):
            if request.method not in methods:
                return _error(405, "method_not_allowed", f"Use {' or '.join(methods)}.")
            header = request.headers.get("Authorization", "")
            scheme, _, raw = header.partition(" ")
            identity = agents.agent_identity(raw.strip()) if scheme.lower() == "bearer" else None
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
