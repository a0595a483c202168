"""Error pages: JSON for the API, HTML for people."""

from django.http import HttpResponseServerError
from django.shortcuts import render
from django.template import loader

from controlplane.api import not_found_json, server_error_json


def not_found(request, exception=None):
    if request.path.startswith("/api/"):
        return not_found_json(request, exception)
    return render(request, "404.html", status=404)


def server_error(request):
    if request.path.startswith("/api/"):
        return server_error_json(request)
    # No request context: a context processor may be what failed.
    return HttpResponseServerError(loader.get_template("500.html").render())
