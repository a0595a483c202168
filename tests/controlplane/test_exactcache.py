"""The exact cache: after a committed change the next look-up reads the database, the ones
after it are cached again, and an answer read before a change is never served after it."""

import pytest

from controlplane.exactcache import ExactCache

pytestmark = pytest.mark.django_db


class Database:
    """What the cache stands in front of, counting how often it is asked."""

    def __init__(self, value):
        self.value = value
        self.reads = 0

    def read(self):
        self.reads += 1
        return self.value


def look_up(cache: ExactCache, database: Database, name="k"):
    value = cache.recall(name)
    if value is None:
        value = database.read()
        cache.remember(name, value)
    return value


@pytest.fixture
def exact(request):
    # A prefix of its own per test, so entries left in a shared cache (Redis) do not leak.
    return ExactCache(f"test-exact:{request.node.name}", max_timeout_s=60)


def test_answers_are_cached_until_a_change_then_cached_again(
    exact, django_capture_on_commit_callbacks
):
    database = Database("v1")
    assert [look_up(exact, database) for _ in range(3)] == ["v1"] * 3
    assert database.reads == 1

    database.value = "v2"
    with django_capture_on_commit_callbacks(execute=True):
        exact.forget(["k"])
    assert [look_up(exact, database) for _ in range(3)] == ["v2"] * 3
    assert database.reads == 2  # read once after the change, then cached again


def test_an_answer_read_before_a_change_is_not_served_after_it(
    exact, django_capture_on_commit_callbacks
):
    database = Database("v1")
    with django_capture_on_commit_callbacks(execute=True):
        exact.forget(["k"])  # a first change: the key now holds a marker
    # A slow reader finds that marker and reads the database...
    assert exact.recall("k") is None
    stale = database.read()
    # ...then a second change commits before the slow reader caches what it read.
    database.value = "v2"
    with django_capture_on_commit_callbacks(execute=True):
        exact.forget(["k"])
    exact.remember("k", stale)

    assert look_up(exact, database) == "v2"
    assert look_up(exact, database) == "v2"
    assert database.reads == 2  # the fresh answer, read once and then cached


def test_a_reader_without_a_marker_cannot_cache_over_a_change(
    exact, django_capture_on_commit_callbacks
):
    database = Database("v1")
    assert exact.recall("k") is None  # nothing cached: it reads the database
    stale = database.read()
    database.value = "v2"
    with django_capture_on_commit_callbacks(execute=True):
        exact.forget(["k"])
    exact.remember("k", stale)  # too late: the marker is there

    assert look_up(exact, database) == "v2"


def test_an_uncommitted_change_marks_nothing(exact, django_capture_on_commit_callbacks):
    database = Database("v1")
    look_up(exact, database)
    with django_capture_on_commit_callbacks(execute=False):
        exact.forget(["k"])  # rolled back: its callbacks never run
    assert look_up(exact, database) == "v1"
    assert database.reads == 1


class CountingCache:
    """Django's cache, counting its round trips."""

    def __init__(self, real):
        self.real, self.gets, self.get_manys = real, 0, 0

    def get(self, key, *args, **kwargs):
        self.gets += 1
        return self.real.get(key, *args, **kwargs)

    def get_many(self, keys, *args, **kwargs):
        self.get_manys += 1
        return self.real.get_many(keys, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def counted(monkeypatch):
    from controlplane import cache, exactcache

    counting = CountingCache(exactcache.cache)
    monkeypatch.setattr(exactcache, "cache", counting)
    monkeypatch.setattr(cache, "cache", counting)  # cache_get reads through best_effort
    return counting


def test_keys_read_ahead_answer_their_first_look_up_in_one_round_trip(exact, counted):
    from controlplane.exactcache import cache_get, read_ahead

    other = ExactCache(f"{exact.prefix}-other", max_timeout_s=60)
    look_up(exact, Database("a"))
    look_up(other, Database("b"))
    counted.gets = 0
    with read_ahead([*exact.keys_ahead("k"), *other.keys_ahead("k"), f"{exact.prefix}:absent"]):
        assert counted.get_manys == 1
        assert (exact.recall("k"), other.recall("k")) == ("a", "b")
        assert cache_get(f"{exact.prefix}:absent") is None  # read ahead: not there
        assert counted.gets == 0
        counted.real.set(f"{exact.prefix}:k", "written since", 60)
        assert exact.recall("k") == "written since"  # a second look-up asks the cache
        assert counted.gets == 1
    assert other.recall("k") == "b" and counted.gets == 2  # outside the block: the cache


def test_a_marker_read_ahead_sends_the_reader_to_the_database_then_its_answer_comes_with_it(
    exact, counted, django_capture_on_commit_callbacks
):
    from controlplane.exactcache import read_ahead

    database = Database("v1")
    look_up(exact, database)
    database.value = "v2"
    with django_capture_on_commit_callbacks(execute=True):
        exact.forget(["k"])
    with read_ahead(exact.keys_ahead("k")):
        assert look_up(exact, database) == "v2" and database.reads == 2
    # While the marker stands, the answer cached under it is read in the same round trip.
    counted.gets = counted.get_manys = 0
    with read_ahead(exact.keys_ahead("k")):
        assert look_up(exact, database) == "v2"
    assert (counted.get_manys, counted.gets, database.reads) == (1, 0, 2)

    # A newer change's marker: the answer read ahead (under the older one) is not served.
    database.value = "v3"
    with django_capture_on_commit_callbacks(execute=True):
        exact.forget(["k"])
    with read_ahead(exact.keys_ahead("k")):
        assert look_up(exact, database) == "v3"
    assert database.reads == 3
    with read_ahead(exact.keys_ahead("k")):
        assert look_up(exact, database) == "v3"
    assert database.reads == 3

    # Once the marker has gone, the entry alone is read ahead again.
    counted.real.delete(f"{exact.prefix}:k")
    look_up(exact, database)
    assert exact.keys_ahead("k") == [f"{exact.prefix}:k"]


def test_a_cache_that_fails_reads_nothing_ahead(exact, counted, monkeypatch):
    from controlplane.exactcache import cache_get, read_ahead

    look_up(exact, Database("a"))

    def broken(keys, *args, **kwargs):
        raise ConnectionError("cache down")

    monkeypatch.setattr(counted, "get_many", broken)
    with read_ahead(exact.keys_ahead("k")):
        assert cache_get(f"{exact.prefix}:k") == "a"  # asked again, and answered
