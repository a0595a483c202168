"""Error pages: JSON for the API, HTML for people."""

import sys

from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, HttpResponseServerError, JsonResponse
from django.shortcuts import render
from django.template import loader

from controlplane.api import error_body, not_found_json, server_error_json

RETRY_AFTER_S = 5  # what a client waiting for the database is told to wait


def not_found(request, exception=None):
    if request.path.startswith("/api/"):
        return not_found_json(request, exception)
    return render(request, "404.html", status=404)


def server_error(request):
    """Django calls this while it handles the exception, so it can tell what failed: the
    database unreachable (restarting, failing over) is a 503 the client may retry after a
    moment, with the same Idempotency-Key for a submit; anything else is our fault, a 500."""
    if isinstance(sys.exc_info()[1], OperationalError | InterfaceError):
        return _database_unavailable(request)
    if request.path.startswith("/api/"):
        return server_error_json(request)
    # No request context: a context processor may be what failed.
    return HttpResponseServerError(loader.get_template("500.html").render())


def _database_unavailable(request) -> HttpResponse:
    message = "The database cannot be reached just now; retry in a few seconds."
    if request.path.startswith("/api/"):
        response = JsonResponse(error_body("unavailable", message), status=503)
    else:
        response = HttpResponse(message, status=503, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response
