"""A lock through Django's cache, so one periodic pass runs at a time across workers."""

import contextlib
import uuid

from django.core.cache import cache


@contextlib.contextmanager
def single_flight(name: str, *, ttl_s: int):
    """Yield True if we hold the lock `name`, False if someone else does.

    `cache.add` is atomic on Redis and on the database cache. The TTL frees the
    lock if the holder dies; release deletes it only if it is still ours.
    """
    key = f"lock:{name}"
    token = uuid.uuid4().hex
    acquired = cache.add(key, token, timeout=ttl_s)
    try:
        yield acquired
    finally:
        if acquired and cache.get(key) == token:
            cache.delete(key)
