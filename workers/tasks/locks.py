"""A lock through Django's cache, so one periodic pass runs at a time across workers."""

import contextlib
import logging
import threading
import time
import uuid

from django.core.cache import cache

log = logging.getLogger(__name__)

LEASE_S = 15  # how long a lock outlives a holder that died, or a release Redis never saw


@contextlib.contextmanager
def single_flight(name: str, *, ttl_s: int, lease_s: int = LEASE_S):
    """Yield True if we hold the lock `name`, False if someone else does (or the cache
    cannot be reached: the beat tries again).

    `cache.add` is atomic on Redis and on the database cache. The lock is a short lease
    that a thread renews while the holder works, for at most `ttl_s` seconds: a holder
    that dies, or a release lost because Redis was down at that moment, holds the lock
    `lease_s` seconds more, not minutes. Release deletes it only if it is still ours.
    """
    key = f"lock:{name}"
    token = uuid.uuid4().hex
    try:
        acquired = cache.add(key, token, timeout=lease_s)
    except Exception:
        log.warning("cache unreachable: %s not taken", key, exc_info=True)
        acquired = False
    done = threading.Event()
    renewer = None
    if acquired:
        renewer = threading.Thread(
            target=_renew,
            args=(key, token, lease_s, time.monotonic() + ttl_s, done),
            name=f"lease:{name}",
            daemon=True,
        )
        renewer.start()
    try:
        yield acquired
    finally:
        done.set()
        if renewer is not None:
            renewer.join()
            with contextlib.suppress(Exception):  # down: the lease ends by itself
                if cache.get(key) == token:
                    cache.delete(key)


def _renew(key: str, token: str, lease_s: int, until: float, done: threading.Event) -> None:
    while not done.wait(lease_s / 3) and time.monotonic() < until:
        try:
            if cache.get(key) != token:
                return  # lost (it lapsed while the cache was away): nothing of ours to renew
            cache.touch(key, lease_s)
        except Exception:
            log.warning("cache unreachable: lease %s not renewed", key, exc_info=True)
