"""Password sign-in, throttled: failed attempts are counted in Django's cache per username
and address, and per address, and past a limit further attempts are refused before any
password is hashed. Each check costs a PBKDF2 of a million iterations, so unthrottled it
is both a way to guess passwords and a way to load the server.

Every password check goes through Django's `authenticate()`, hence through this backend
(the login page, the admin's, and anything added later); the sign-in forms ask
`signin_refused` first only to say why.
"""

import hashlib

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied

from apps.accounts.middleware import client_address
from controlplane.cache import best_effort


def _keys(request, username: str) -> tuple[str, str]:
    """(the username-and-address counter, the address counter); hashed, since a forwarded
    address and a username are whatever the client sent."""
    address = (client_address(request) if request is not None else None) or "-"

    def digest(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]

    user_and_address = digest(username.casefold() + "\n" + address)
    return f"signin:fail:{user_and_address}", f"signin:fail-address:{digest(address)}"


def signin_refused(request, username: str) -> bool:
    """Whether this address has failed too often, for this username or for any."""
    user_key, address_key = _keys(request, username)
    return (best_effort.get(user_key) or 0) >= settings.LOGIN_FAILURES_PER_USER or (
        best_effort.get(address_key) or 0
    ) >= settings.LOGIN_FAILURES_PER_ADDRESS


def _failed(request, username: str) -> None:
    for key in _keys(request, username):
        best_effort.count(key, timeout=settings.LOGIN_FAILURE_WINDOW_S)


def _succeeded(request, username: str) -> None:
    # Only the username's count: a guesser who owns one account must not clear the address's.
    best_effort.delete(_keys(request, username)[0])


class ThrottledModelBackend(ModelBackend):
    """Django's username and password check, refused while the throttle holds."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if username is None or password is None:
            return None
        username = str(username)
        if signin_refused(request, username):
            raise PermissionDenied  # authenticate() stops here: no backend hashes anything
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            _failed(request, username)
        else:
            _succeeded(request, username)
        return user
