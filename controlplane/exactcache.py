"""Look-ups answered from Django's cache that are never stale after a committed change.

Used where every request asks the same question of the database (who does this
API token or node token stand for?). Writers that change the answer call
`forget(keys)`: once their transaction commits, each key holds a RECHECK marker
with a fresh generation for longer than any entry lives. A reader that finds a
marker reads the database (which already holds the change, since the marker
was set after the commit) and caches its answer under the marker's generation
(`key@generation`), where the readers after it find it. A writer's next change
sets a new generation, so an answer read before that change, cached late under
the old one, is never read again. Readers fill the plain key with `add`, which
never overwrites a marker, so a reader that read the database just before a
change cannot put the old answer back there either. A cache that fails is
skipped: the database answers, as it would without one.
"""

import logging
import threading
import uuid

from django.core.cache import cache
from django.db import transaction

from controlplane.cache import best_effort

log = logging.getLogger(__name__)

RECHECK = "recheck"


class ExactCache:
    def __init__(self, prefix: str, *, max_timeout_s: float):
        self.prefix = prefix
        self.max_timeout_s = max_timeout_s
        # name → the generation this thread's last recall found (remember caches under it)
        self._seen = threading.local()

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def _generations(self) -> dict[str, str]:
        if not hasattr(self._seen, "generations"):
            self._seen.generations = {}
        return self._seen.generations

    def recall(self, name: str):
        """The cached value, or None when the database must answer."""
        generations = self._generations()
        generations.pop(name, None)
        if self.max_timeout_s <= 0:
            return None
        try:
            value = best_effort.get(self._key(name))
            if isinstance(value, str) and value.startswith(RECHECK):
                generation = value.partition(":")[2]
                if not generation:  # a marker without one: ask the database, cache nothing
                    return None
                generations[name] = generation
                value = best_effort.get(f"{self._key(name)}@{generation}")
        except Exception:  # the cache is an optimisation; the database still answers
            log.warning("%s: cache unreachable; reading the database", self.prefix, exc_info=True)
            return None
        return value

    def remember(self, name: str, value, *, timeout: float | None = None) -> None:
        """Cache what the database answered after recall(name) found nothing."""
        generation = self._generations().pop(name, None)
        timeout = self.max_timeout_s if timeout is None else min(timeout, self.max_timeout_s)
        if timeout < 1:
            return
        key = self._key(name) if generation is None else f"{self._key(name)}@{generation}"
        try:
            cache.add(key, value, timeout=timeout)
        except Exception:
            log.warning("%s: cache unreachable; not caching", self.prefix, exc_info=True)

    def forget(self, names) -> None:
        """Once this transaction commits, the next look-up of these names reads the database."""
        names = list(names)
        if not names:
            return

        def mark():
            try:
                generation = uuid.uuid4().hex
                cache.set_many(
                    {self._key(n): f"{RECHECK}:{generation}" for n in names},
                    timeout=2 * self.max_timeout_s + 60,
                )
            except Exception:
                log.error("%s: could not mark cached entries stale", self.prefix, exc_info=True)

        transaction.on_commit(mark)
