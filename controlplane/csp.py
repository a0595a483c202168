"""The Content-Security-Policy of every HTML page: scripts, styles and everything else come
from this site's own files (no inline code, so markup injected into a page cannot run),
pages are never framed, and forms post only here."""

from django.conf import settings

POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",  # Swagger UI's stylesheet draws its icons as data: URIs
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if (
            response.get("Content-Type", "").startswith("text/html")
            and "Content-Security-Policy" not in response
            # Django's debug pages (DEBUG only) are made of inline styles and scripts.
            and not (settings.DEBUG and response.status_code >= 400)
        ):
            response["Content-Security-Policy"] = POLICY
        return response
