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
