"""API authentication: bearer tokens for CI and the CLI, sessions for the browser."""

from rest_framework import authentication, exceptions

from apps.accounts.services import TokenRejected, api_token_use

KEYWORDS = ("bearer", "token")


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer cp_...` (or `Token cp_...`)."""

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower().decode("latin-1") not in KEYWORDS:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("The Authorization header needs one token.")
        try:
            raw = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        try:
            token = api_token_use(raw=raw)
        except TokenRejected as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from None
        return token.user, token

    def authenticate_header(self, request):
        return 'Bearer realm="api"'


class BrowserSessionAuthentication(authentication.SessionAuthentication):
    """The logged-in browser session, with Django's CSRF check on writes."""
