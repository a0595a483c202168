"""GPU telemetry kept over time: the flush's samples, the one-minute rollup and retention."""

import datetime as dt

import pytest
from django.core.cache import cache

from apps.fleet import agents, telemetry
from apps.fleet.models import GpuMinute, GpuSample, Node
from tests import factories
from tests.apps.fleet.test_agents import _registered, report

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def samples(node, at, *, utilization, gpus=2, temperature=60, power=400, memory=1000):
    return [(node.pk, at, i, utilization + i, memory, temperature, power) for i in range(gpus)]


def test_a_flushed_heartbeat_keeps_one_sample_per_gpu():
    node, client = _registered()
    answer = client.post(
        "/api/v1/agent/heartbeat",
        report(8, utilization=73.4, temperature_c=61.6, power_w=512.2, memory_used_mib=2048),
        format="json",
    )
    assert answer.status_code == 200
    assert agents.nodes_heartbeats_flush()["written"] == 1
    rows = list(GpuSample.objects.filter(node=node).order_by("gpu"))
    assert [row.gpu for row in rows] == list(range(8))
    heard = Node.objects.get(pk=node.pk).last_heartbeat_at
    assert {row.at for row in rows} == {heard}
    assert (rows[3].utilization_pct, rows[3].temperature_c, rows[3].power_w) == (73, 62, 512)
    assert rows[3].memory_used_mib == 2048
    # Nothing new landed: the next flush keeps no second sample.
    agents.nodes_heartbeats_flush()
    assert GpuSample.objects.filter(node=node).count() == 8


def test_a_gpu_reported_twice_and_missing_readings_do_not_break_the_flush():
    node, client = _registered()
    body = report(2, utilization=None)
    body["metrics"]["gpus"].append({**body["metrics"]["gpus"][0], "utilization": 10.0})
    client.post("/api/v1/agent/heartbeat", body, format="json")
    assert agents.nodes_heartbeats_flush()["written"] == 1
    rows = dict(GpuSample.objects.filter(node=node).values_list("gpu", "utilization_pct"))
    assert rows == {0: 10, 1: None}  # the last reading of GPU 0 is kept


def test_the_rollup_averages_finished_minutes_and_skips_the_current_one():
    cache.delete(telemetry.ROLLED_UP_TO_KEY)
    node = factories.make_node()
    rows = []
    for second, utilization in ((0, 10), (15, 20), (30, 30), (45, 40)):  # 12:00
        rows += samples(node, T0 + dt.timedelta(seconds=second), utilization=utilization)
    rows += samples(node, T0 + dt.timedelta(minutes=1, seconds=5), utilization=90)  # 12:01
    rows += samples(node, T0 + dt.timedelta(minutes=3), utilization=50)  # not finished yet
    telemetry.gpu_samples_record(rows=rows)

    now = T0 + dt.timedelta(minutes=3, seconds=10)  # 12:03 is inside the grace
    counts = telemetry.gpu_telemetry_rollup(now=now)

    assert counts["minutes"] == 4  # two minutes × two GPUs
    means = {(row.at, row.gpu): row.utilization_pct for row in GpuMinute.objects.filter(node=node)}
    assert means == {
        (T0, 0): 25,
        (T0, 1): 26,
        (T0 + dt.timedelta(minutes=1), 0): 90,
        (T0 + dt.timedelta(minutes=1), 1): 91,
    }
    minute = GpuMinute.objects.get(node=node, at=T0, gpu=0)
    assert (minute.temperature_c, minute.power_w, minute.memory_used_mib) == (60, 400, 1000)

    # The next pass starts where this one ended: 12:02 and 12:03 once they are finished.
    later = telemetry.gpu_telemetry_rollup(now=now + dt.timedelta(minutes=2))
    assert later["minutes"] == 2
    assert GpuMinute.objects.filter(node=node, at=T0 + dt.timedelta(minutes=3)).count() == 2


def test_a_rollup_run_again_writes_the_same_means():
    node = factories.make_node()
    telemetry.gpu_samples_record(rows=samples(node, T0 + dt.timedelta(seconds=5), utilization=40))
    telemetry.gpu_samples_record(rows=samples(node, T0 + dt.timedelta(seconds=50), utilization=60))
    now = T0 + dt.timedelta(minutes=2)
    cache.delete(telemetry.ROLLED_UP_TO_KEY)
    telemetry.gpu_telemetry_rollup(now=now)
    # A late sample of the same minute, and the watermark lost (a flushed cache): the
    # minute is averaged again, in place.
    telemetry.gpu_samples_record(rows=samples(node, T0 + dt.timedelta(seconds=55), utilization=80))
    cache.delete(telemetry.ROLLED_UP_TO_KEY)
    telemetry.gpu_telemetry_rollup(now=now)
    assert GpuMinute.objects.filter(node=node).count() == 2
    assert GpuMinute.objects.get(node=node, at=T0, gpu=0).utilization_pct == 60


def test_retention_deletes_only_what_is_past_its_window(settings):
    settings.TELEMETRY_RAW_RETENTION_S = 24 * 3600
    settings.TELEMETRY_MINUTE_RETENTION_S = 30 * 24 * 3600
    nodes = [factories.make_node() for _ in range(3)]
    now = T0
    for node in nodes:
        telemetry.gpu_samples_record(
            rows=samples(node, now - dt.timedelta(hours=25), utilization=1)
            + samples(node, now - dt.timedelta(hours=23), utilization=2)
        )
        GpuMinute.objects.bulk_create(
            [
                GpuMinute(node=node, at=now - dt.timedelta(days=31), gpu=0, utilization_pct=1),
                GpuMinute(node=node, at=now - dt.timedelta(days=29), gpu=0, utilization_pct=2),
            ]
        )
    counts = telemetry.gpu_telemetry_purge(now=now)
    assert counts == {"samples_deleted": 3 * 2, "minutes_deleted": 3}
    assert set(GpuSample.objects.values_list("utilization_pct", flat=True)) == {2, 3}
    assert set(GpuMinute.objects.values_list("utilization_pct", flat=True)) == {2}


def test_retention_windows_are_settings(settings):
    node = factories.make_node()
    telemetry.gpu_samples_record(rows=samples(node, T0 - dt.timedelta(hours=2), utilization=5))
    settings.TELEMETRY_RAW_RETENTION_S = 3 * 3600
    assert telemetry.gpu_telemetry_purge(now=T0)["samples_deleted"] == 0
    settings.TELEMETRY_RAW_RETENTION_S = 3600
    assert telemetry.gpu_telemetry_purge(now=T0)["samples_deleted"] == 2


def test_a_deleted_node_takes_its_readings_with_it():
    node = factories.make_node()
    telemetry.gpu_samples_record(rows=samples(node, T0, utilization=5))
    GpuMinute.objects.create(node=node, at=T0, gpu=0, utilization_pct=5)
    node.delete()
    assert not GpuSample.objects.exists() and not GpuMinute.objects.exists()


def test_the_rollup_task_is_on_beats_schedule(settings):
    from workers.tasks.fleet import telemetry_rollup

    entry = settings.CELERY_BEAT_SCHEDULE["fleet-telemetry-rollup"]
    assert entry["task"] == telemetry_rollup.name == "fleet.telemetry_rollup"
    assert entry["schedule"] == settings.TELEMETRY_ROLLUP_EVERY_S
    assert set(telemetry_rollup.apply().get()) == {"minutes", "samples_deleted", "minutes_deleted"}
