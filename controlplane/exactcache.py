"""Look-ups answered from Django's cache that are never stale after a committed change.

Used where every request asks the same question of the database (who does this
API token or node token stand for?). Writers that change the answer call
`forget(keys)`: once their transaction commits, each key holds a RECHECK marker
for longer than any entry lives. Readers that find the marker ask the database
and do not cache; readers fill the cache with `add`, which never overwrites a
marker, so a reader that read the database just before the change cannot put
the old answer back. A cache that fails is skipped: the database answers, as
it would without one.
"""

import logging

from django.core.cache import cache
from django.db import transaction

log = logging.getLogger(__name__)

RECHECK = "recheck"


class ExactCache:
    def __init__(self, prefix: str, *, max_timeout_s: float):
        self.prefix = prefix
        self.max_timeout_s = max_timeout_s

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def recall(self, name: str):
        """The cached value, or None when the database must answer."""
        if self.max_timeout_s <= 0:
            return None
        try:
            value = cache.get(self._key(name))
        except Exception:  # the cache is an optimisation; the database still answers
            log.warning("%s: cache unreachable; reading the database", self.prefix, exc_info=True)
            return None
        return None if value is None or value == RECHECK else value

    def remember(self, name: str, value, *, timeout: float | None = None) -> None:
        timeout = self.max_timeout_s if timeout is None else min(timeout, self.max_timeout_s)
        if timeout < 1:
            return
        try:
            cache.add(self._key(name), value, timeout=timeout)
        except Exception:
            log.warning("%s: cache unreachable; not caching", self.prefix, exc_info=True)

    def forget(self, names) -> None:
        """Once this transaction commits, the next look-up of these names reads the database."""
        names = list(names)
        if not names:
            return

        def mark():
            try:
                cache.set_many(
                    {self._key(n): RECHECK for n in names},
                    timeout=2 * self.max_timeout_s + 60,
                )
            except Exception:
                log.error("%s: could not mark cached entries stale", self.prefix, exc_info=True)

        transaction.on_commit(mark)
