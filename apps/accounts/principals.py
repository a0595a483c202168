"""What a bearer token stands for (the token, its user, the user's roles), kept in
Django's cache so that most API requests skip the database for authentication.

Exact, not eventually right (controlplane/exactcache.py): every write that could
change the answer (a token revoked, a user deactivated, a membership or org role
changed) marks the entries of that user's tokens stale once it commits.
"""

from django.conf import settings

from controlplane.exactcache import ExactCache

_tokens = ExactCache("auth:token", max_timeout_s=settings.AUTH_CACHE_S)


def recall(digest: str):
    """(token, roles) as cached, or None when the database must answer."""
    return _tokens.recall(digest)


def remember(digest: str, token, roles, *, timeout: float) -> None:
    """Cache a token's answer for `timeout` seconds, AUTH_CACHE_S at most."""
    _tokens.remember(digest, (token, roles), timeout=timeout)


def forget_digests(digests: list[str]) -> None:
    _tokens.forget(digests)


def forget_user(user_id: int) -> None:
    from apps.accounts.models import ApiToken

    forget_digests(list(ApiToken.objects.filter(user_id=user_id).values_list("digest", flat=True)))
