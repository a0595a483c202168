"""Django's Redis cache, with one Redis client per connection pool instead of one per call.

Django builds a new `redis.Redis` for every cache operation, and building one
(its response-callback table) costs more than the round trip to Redis itself.
A client is safe to share between threads: it takes a connection from its pool
for each command.
"""

from django.core.cache.backends.redis import RedisCache, RedisCacheClient


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
