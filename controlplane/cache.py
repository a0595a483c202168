"""Django's Redis cache, with one Redis client per connection pool instead of one per call.

Django builds a new `redis.Redis` for every cache operation, and building one
(its response-callback table) costs more than the round trip to Redis itself.
A client is safe to share between threads: it takes a connection from its pool
for each command.
"""

import logging

from django.core.cache import cache
from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.redis import RedisCache, RedisCacheClient

log = logging.getLogger(__name__)


class SharedClientRedisCacheClient(RedisCacheClient):
    def get_client(self, key=None, *, write=False):
        pool = self._get_connection_pool(write)
        clients = self.__dict__.setdefault("_clients", {})
        client = clients.get(id(pool))
        if client is None:
            client = clients[id(pool)] = self._client(connection_pool=pool)
        return client


class SharedClientRedisCache(RedisCache):
    def __init__(self, server, params):
        super().__init__(server, params)
        self._class = SharedClientRedisCacheClient


class BestEffort:
    """Django's cache where it only saves work or publishes a hint: a cache that cannot be
    reached reads as empty and takes nothing (with a warning), so a Redis outage slows
    submissions and pages but breaks none. `add` answers False then, which callers that
    use it to coalesce or to claim read as "someone else has it"."""

    def get(self, key: str, default=None):
        try:
            return cache.get(key, default)
        except Exception:
            log.warning("cache unreachable: %s read as missing", key, exc_info=True)
            return default

    def set(self, key: str, value, timeout=DEFAULT_TIMEOUT) -> None:
        try:
            cache.set(key, value, timeout)
        except Exception:
            log.warning("cache unreachable: %s not stored", key, exc_info=True)

    def add(self, key: str, value, timeout=DEFAULT_TIMEOUT) -> bool:
        try:
            return cache.add(key, value, timeout)
        except Exception:
            log.warning("cache unreachable: %s not added", key, exc_info=True)
            return False

    def count(self, key: str, *, timeout: float) -> int | None:
        """Add one to the counter at `key`, which is forgotten `timeout` seconds after its
        latest count; the new count, or None when the cache cannot be reached."""
        try:
            cache.add(key, 0, timeout)
            counted = cache.incr(key)
            # Django's incr keeps the expiry on Redis but resets it to the default on the
            # database cache: set it here, so both forget at the same time.
            cache.touch(key, timeout)
            return counted
        except Exception:
            log.warning("cache unreachable: %s not counted", key, exc_info=True)
            return None

    def delete(self, key: str) -> None:
        try:
            cache.delete(key)
        except Exception:
            log.warning("cache unreachable: %s not deleted", key, exc_info=True)


best_effort = BestEffort()
