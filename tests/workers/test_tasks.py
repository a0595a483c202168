"""Celery tasks through a real worker and the configured broker (Redis in CI,
the filesystem transport otherwise), and the cache lock they share."""

import datetime as dt
import threading
import time

import pytest
from celery.contrib.testing.worker import start_worker
from django.db import connection
from django.utils import timezone

from apps.fleet.models import Node, NodeEvent, NodeState
from apps.fleet.services import nodes_heartbeat_sweep
from controlplane.celery import app
from tests.apps.fleet.test_services import ready_node
from workers.tasks import fleet as fleet_tasks
from workers.tasks.locks import single_flight


def _wait_until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_the_sweep_task_is_acked_late_and_survives_a_lost_worker():
    task = app.tasks["fleet.heartbeat_sweep"]
    assert task.acks_late is True
    assert task.reject_on_worker_lost is True


def test_the_beat_schedule_runs_the_sweep():
    schedule = app.conf.beat_schedule
    assert schedule["fleet-heartbeat-sweep"]["task"] == "fleet.heartbeat_sweep"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_runs_the_sweep_sent_through_the_broker(settings):
    node = ready_node()
    stale = timezone.now() - dt.timedelta(seconds=settings.NODE_SUSPECT_AFTER_S + 30)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=stale)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        fleet_tasks.heartbeat_sweep.delay()
        assert _wait_until(lambda: Node.objects.get(pk=node.pk).state == NodeState.SUSPECT)
    assert NodeEvent.objects.filter(node=node, to_state=NodeState.SUSPECT).count() == 1


@pytest.mark.django_db
def test_only_one_holder_of_a_lock_at_a_time():
    with (
        single_flight("test.lock", ttl_s=30) as first,
        single_flight("test.lock", ttl_s=30) as second,
    ):
        assert first is True and second is False
    with single_flight("test.lock", ttl_s=30) as after_release:
        assert after_release is True


@pytest.mark.django_db
def test_a_sweep_that_finds_the_lock_taken_skips():
    with single_flight("fleet.heartbeat_sweep", ttl_s=30):
        assert fleet_tasks.heartbeat_sweep() == {"skipped": "another sweep is running"}


@pytest.mark.redis
def test_the_redis_lock_expires_when_its_holder_dies():
    from django.core.cache import cache, caches
    from django.core.cache.backends.redis import RedisCache

    assert isinstance(caches["default"], RedisCache)
    cache.add("lock:test.expiry", "dead-holder", timeout=1)
    with single_flight("test.expiry", ttl_s=5) as taken:
        assert taken is False
    time.sleep(1.2)
    with single_flight("test.expiry", ttl_s=5) as taken:
        assert taken is True


@pytest.mark.redis
def test_a_held_lock_is_renewed_past_its_lease_and_lapses_soon_after_a_lost_release():
    """The lease is renewed while its holder works; a release Redis never saw (Redis
    down at that moment) or a holder that died keeps the lock one lease, not minutes."""
    from django.core.cache import cache

    with single_flight("test.lease", ttl_s=30, lease_s=1) as held:
        assert held is True
        time.sleep(2.5)  # well past one lease: renewed meanwhile
        with single_flight("test.lease", ttl_s=30, lease_s=1) as second:
            assert second is False
        token = cache.get("lock:test.lease")
    # The release Redis never saw: the same token put back, as if the delete was lost.
    cache.set("lock:test.lease", token, timeout=1)
    with single_flight("test.lease", ttl_s=30) as right_after:
        assert right_after is False
    time.sleep(1.3)
    with single_flight("test.lease", ttl_s=30) as after_the_lease:
        assert after_the_lease is True


def test_a_lock_the_cache_cannot_take_reads_as_held_elsewhere(settings):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings.CACHES = {
        "default": {
            "BACKEND": "controlplane.cache.SharedClientRedisCache",
            "LOCATION": f"redis://127.0.0.1:{port}/0",
        }
    }
    with single_flight("test.gone", ttl_s=5) as taken:
        assert taken is False


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_sweeps_move_each_node_once(settings):
    nodes = [ready_node() for _ in range(40)]
    stale = timezone.now() - dt.timedelta(hours=1)
    Node.objects.update(last_heartbeat_at=stale)
    barrier = threading.Barrier(3)
    results = []

    def sweep():
        barrier.wait()
        try:
            results.append(nodes_heartbeat_sweep())
        finally:
            connection.close()

    threads = [threading.Thread(target=sweep) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(r["suspect"] for r in results) == len(nodes)
    for node in nodes:
        assert NodeEvent.objects.filter(node=node, to_state=NodeState.SUSPECT).count() == 1


@pytest.mark.django_db
def test_after_the_control_plane_could_not_sweep_no_node_goes_down_until_agents_are_heard(
    settings,
):
    """A sweep after a gap (the database or the workers were down, so no heartbeat could be
    taken) marks silent nodes SUSPECT but none DOWN for NODE_SUSPECT_AFTER_S: part of their
    silence is the control plane's own. Once that has passed, DOWN as before."""
    from django.core.cache import cache

    node = ready_node()
    long_ago = timezone.now() - dt.timedelta(seconds=settings.NODE_DOWN_AFTER_S + 30)
    Node.objects.filter(pk=node.pk).update(state=NodeState.SUSPECT, last_heartbeat_at=long_ago)
    cache.set(fleet_tasks.SWEPT_KEY, time.time() - 10 * settings.NODE_SWEEP_EVERY_S)

    counts = fleet_tasks.heartbeat_sweep()
    assert counts["down"] == 0
    assert Node.objects.get(pk=node.pk).state == NodeState.SUSPECT
    assert fleet_tasks.heartbeat_sweep()["down"] == 0  # still within the window

    cache.set(fleet_tasks.DEAF_KEY, time.time() - 1)  # the window has passed
    assert fleet_tasks.heartbeat_sweep()["down"] == 1
    assert Node.objects.get(pk=node.pk).state == NodeState.DOWN


@pytest.mark.django_db
def test_sweeps_without_a_gap_mark_long_silent_nodes_down(settings):
    from django.core.cache import cache

    node = ready_node()
    long_ago = timezone.now() - dt.timedelta(seconds=settings.NODE_DOWN_AFTER_S + 30)
    Node.objects.filter(pk=node.pk).update(state=NodeState.SUSPECT, last_heartbeat_at=long_ago)
    cache.set(fleet_tasks.SWEPT_KEY, time.time())
    assert fleet_tasks.heartbeat_sweep()["down"] == 1
