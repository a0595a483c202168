"""What a bearer token stands for (the token, its user, the user's roles), kept in
Django's cache so that most API requests skip the database for authentication.

Exact, not eventually right: every write that could change the answer (a token
revoked, a user deactivated, a membership or org role changed) replaces the
entries of that user's tokens with a RECHECK marker once it commits. A reader
that finds the marker goes to the database and does not cache, and readers fill
the cache with `add`, which never overwrites a marker, so a request that read
the database just before a revocation cannot put the old answer back. A cache
that fails is skipped: authentication then reads the database, as without one.
"""

import logging

from django.conf import settings
from django.core.cache import cache
from django.db import transaction

log = logging.getLogger(__name__)

RECHECK = "recheck"


def _key(digest: str) -> str:
    return f"auth:token:{digest}"


def recall(digest: str):
    """(token, roles) as cached, or None when the database must answer."""
    if settings.AUTH_CACHE_S <= 0:
        return None
    try:
        entry = cache.get(_key(digest))
    except Exception:  # the cache is an optimisation; the database still answers
        log.warning("auth cache unreachable; reading the database", exc_info=True)
        return None
    return None if entry is None or entry == RECHECK else entry


def remember(digest: str, token, roles, *, timeout: float) -> None:
    """Cache a token's answer for `timeout` seconds, AUTH_CACHE_S at most."""
    timeout = min(timeout, settings.AUTH_CACHE_S)
    if timeout < 1:
        return
    try:
        cache.add(_key(digest), (token, roles), timeout=timeout)
    except Exception:
        log.warning("auth cache unreachable; not caching", exc_info=True)


def forget_digests(digests: list[str]) -> None:
    """After this transaction commits, make the next use of these tokens read the database."""
    if not digests:
        return

    def mark():
        try:
            # Longer than any entry lives, so no stale entry can outlast its marker.
            cache.set_many(
                {_key(d): RECHECK for d in digests}, timeout=2 * settings.AUTH_CACHE_S + 60
            )
        except Exception:
            log.error("could not mark cached tokens stale", exc_info=True)

    transaction.on_commit(mark)


def forget_user(user_id: int) -> None:
    from apps.accounts.models import ApiToken

    forget_digests(list(ApiToken.objects.filter(user_id=user_id).values_list("digest", flat=True)))
