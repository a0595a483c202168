"""Job submissions' short road: `POST /api/v1/jobs/` with an API token, in front of Django.

CI pipelines submit through the API by the thousand; Django's middleware, URL
resolution and DRF's request handling cost about as much CPU as the submission
itself (bench/api.py, bench/RESULTS.md). This road (controlplane/shortroads.py)
takes a plain request (a bearer token with the submit scope, a JSON body, nothing
asked of content negotiation) through the view's own steps (`submit_request`, the
same serializers, the same service) and gives the view's answer: the same status,
body and headers.

Anything it cannot answer as the view would goes to Django before anything is
written: a missing or refused token, a body that is not JSON, a spec refused (the
view then answers the same 400 with its details). Once the service has been asked
to write, the road answers itself, a failure included (500, as Django would), so a
submission is never made twice.
"""

import json
import logging

from rest_framework.exceptions import ValidationError
from rest_framework.renderers import JSONRenderer

from apps.accounts import principals
from apps.accounts.authentication import KEYWORDS
from apps.accounts.context import Origin, acting_from
from apps.accounts.middleware import client_address
from apps.accounts.models import TokenScope
from apps.accounts.selectors import team_cache_keys
from apps.accounts.services import TokenRejected, api_token_use, token_allows, token_digest
from apps.fleet.selectors import CAPACITY_CACHE_KEY
from apps.jobs.api import serializers as s
from apps.jobs.api.views import submit_request
from controlplane.api import error_body
from controlplane.errors import ApplicationError
from controlplane.exactcache import read_ahead
from controlplane.shortroads import Answer, bearer_token, short_road

log = logging.getLogger(__name__)

JOBS_PATH = "/api/v1/jobs/"
JOBS_ROUTE = "job-list"  # the URL's name: the route label of the request metrics
ALLOW = (("Allow", "GET, POST, HEAD, OPTIONS"),)  # what DRF says the job list allows
PLAIN_ACCEPT = {"", "*/*", "application/json"}  # asks nothing of DRF's negotiation
_render = JSONRenderer().render


def submit_fast_path(application):
    """Wrap a WSGI application: plain job submissions are answered in front of it."""
    return short_road(
        application,
        method="POST",
        path=JOBS_PATH,
        route=JOBS_ROUTE,
        road=_submit_plain,
        queries=True,  # a job written, or an earlier one read for its idempotency key
    )


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # as DRF's strict JSON parser refuses NaN


def _submit_plain(request) -> Answer | None:
    meta = request.META
    if meta.get("QUERY_STRING") or request.content_type != "application/json":
        return None  # ?format=..., or a body DRF would not parse: the view answers
    if meta.get("HTTP_ACCEPT", "") not in PLAIN_ACCEPT:
        return None
    raw = bearer_token(request, keywords=KEYWORDS)
    if raw is None:
        return None
    try:
        data = json.loads(request.body.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None  # the view answers 400
    # The cache entries a submission looks up, in one round trip rather than three.
    team_id = data.get("team") if isinstance(data, dict) else None
    with read_ahead(
        [
            *principals.cache_keys(token_digest(raw)),
            *(team_cache_keys(team_id) if type(team_id) is int else ()),
            CAPACITY_CACHE_KEY,
        ]
    ):
        return _submit_as(request, raw, data)


def _submit_as(request, raw: str, data) -> Answer | None:
    meta = request.META
    try:
        token = api_token_use(raw=raw)
    except TokenRejected:
        return None  # the view answers 401
    if not token_allows(token, TokenScope.SUBMIT):
        return None  # the view answers 403
    origin = Origin(channel="api", address=client_address(request))
    with acting_from(origin):
        try:
            job, created = submit_request(
                user=token.user, data=data, idempotency_key=meta.get("HTTP_IDEMPOTENCY_KEY", "")
            )
        except (ValidationError, ApplicationError):
            return None  # refused before any write: the view answers with the details
        except Exception:
            # The service may have written: answering here keeps the job from being
            # submitted a second time by the long road.
            log.exception("Internal Server Error: %s (short road)", JOBS_PATH)
            body = error_body("server_error", "Internal error; it has been logged.")
            return Answer(500, _render(body))
    return Answer(201 if created else 200, _render(s.job_answer(job)), ALLOW)
