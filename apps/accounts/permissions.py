"""API permission: authenticated, and a token's scope covers the request."""

from rest_framework import permissions

from apps.accounts.models import ApiToken, TokenScope
from apps.accounts.services import token_allows


class IsAuthenticatedWithScope(permissions.BasePermission):
    """Reads need the `read` scope; writes need the view's `required_scope` (`admin` unless set).

    A browser session carries every scope; the role checks happen in the services.
    """

    message = "This token's scopes do not allow this request."

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated and user.is_active):
            return False
        token = request.auth
        if not isinstance(token, ApiToken):
            return True
        if request.method in permissions.SAFE_METHODS:
            needed = TokenScope.READ
        else:
            needed = getattr(view, "required_scope", TokenScope.ADMIN)
        return token_allows(token, needed)
