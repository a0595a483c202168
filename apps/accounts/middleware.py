"""Records each request's origin (address, channel) for the audit log."""

from django.conf import settings

from apps.accounts.context import Origin, acting_from


def client_address(request) -> str | None:
    """The client's address: behind a trusted proxy, the entry that proxy added to
    X-Forwarded-For (the last one; those before it are whatever the client sent)."""
    if getattr(settings, "TRUST_X_FORWARDED_FOR", False):
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        if forwarded:
            return forwarded.split(",")[-1].strip() or None
    return request.META.get("REMOTE_ADDR") or None


def _channel(path: str) -> str:
    if path.startswith("/api/"):
        return "api"
    if path.startswith("/admin/"):
        return "admin"
    return "page"


class RequestContextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        origin = Origin(channel=_channel(request.path), address=client_address(request))
        with acting_from(origin):
            return self.get_response(request)
