"""Calling a WSGI application as gunicorn would, for the short roads' tests
(apps/fleet/api/shortroad.py): Django's own application beside the road in front of it."""

import contextlib
import io

from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections


@contextlib.contextmanager
def django_and_road(wrap):
    """(Django's WSGI application, the same wrapped by `wrap`)."""
    # As Django's test client does: a request's start and end would otherwise
    # close the test's connection, which holds the test's open transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        django_app = WSGIHandler()
        yield django_app, wrap(django_app)
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def call(
    app,
    *,
    token=None,
    body=b'{"seq": 3}',
    method="POST",
    path="/api/v1/agent/heartbeat",
    host="testserver",
    **extra,
):
    """(status, headers, body) of one request; `extra` adds to the WSGI environ."""
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "HTTP_HOST": host,
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": False,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "wsgi.version": (1, 0),
    }
    if token is not None:
        environ["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    environ.update(extra)
    got = {}

    def start_response(status, headers, exc_info=None):
        got["status"], got["headers"] = int(status[:3]), dict(headers)

    out = app(environ, start_response)
    content = b"".join(out)
    if hasattr(out, "close"):
        out.close()
    return got["status"], got["headers"], content
