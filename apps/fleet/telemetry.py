"""Writes of GPU telemetry kept over time: the heartbeat flush's samples, their one-minute
means, and retention (models/telemetry.py says why the rows are shaped as they are).

The flush (agents.nodes_heartbeats_flush) hands each batch of readings to
`gpu_samples_record`; beat's `fleet.telemetry_rollup` (every TELEMETRY_ROLLUP_EVERY_S)
calls `gpu_telemetry_rollup`, which averages the finished minutes not yet rolled up
and deletes rows past TELEMETRY_RAW_RETENTION_S and TELEMETRY_MINUTE_RETENTION_S.
"""

import datetime as dt
import logging
from collections.abc import Iterable

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Avg
from django.db.models.functions import Round, TruncMinute
from django.utils import timezone

from apps.fleet.models import GpuMinute, GpuSample, Node
from controlplane.bulk import insert_rows

log = logging.getLogger(__name__)

SAMPLE_FIELDS = (
    "node",
    "at",
    "gpu",
    "utilization_pct",
    "memory_used_mib",
    "temperature_c",
    "power_w",
)
READINGS = ("utilization_pct", "memory_used_mib", "temperature_c", "power_w")
SMALLINT_MAX = 32767

# The end of the minutes rolled up so far; without it (a cache flushed), the rollup goes
# back ROLLUP_CATCHUP and writes over any minute it had already written.
ROLLED_UP_TO_KEY = "fleet:telemetry:rolled-up-to"
ROLLUP_CATCHUP = dt.timedelta(minutes=10)
# A minute is rolled up once no more samples can land in it: samples carry the time their
# heartbeat landed and are written by a flush up to one sweep period later.
ROLLUP_GRACE = dt.timedelta(seconds=2 * settings.NODE_SWEEP_EVERY_S)
# Rows deleted per statement: retention deletes node by node, a chunk of nodes at a time.
PURGE_NODES_PER_STATEMENT = 500


def _whole(value, high: int = SMALLINT_MAX) -> int | None:
    return None if value is None else max(-SMALLINT_MAX, min(high, round(value)))


def sample_row(node_id: int, at: dt.datetime, gpu: dict) -> tuple:
    """One GPU's reading of a compacted heartbeat (agents._compact) as a GpuSample row."""
    return (
        node_id,
        at,
        gpu["index"],
        _whole(gpu["utilization"]),
        _whole(gpu["memory_used_mib"], high=2**31 - 1),
        _whole(gpu["temperature_c"]),
        _whole(gpu["power_w"]),
    )


def gpu_samples_record(*, rows: Iterable[tuple]) -> int:
    """Append heartbeat readings (rows as `sample_row` makes them); one per (node, at, gpu).

    COPY on PostgreSQL. A GPU index an agent reported twice in one heartbeat keeps the
    last reading (the key allows one).
    """
    unique = {(row[0], row[1], row[2]): row for row in rows if 0 <= row[2] <= 63}
    return insert_rows(GpuSample, SAMPLE_FIELDS, unique.values())


def _floor_minute(at: dt.datetime) -> dt.datetime:
    return at.replace(second=0, microsecond=0)


def gpu_telemetry_rollup(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Average the finished minutes' samples into GpuMinute rows, then apply retention.

    Returns counts: minutes (GpuMinute rows written), samples_deleted, minutes_deleted.
    """
    now = now or timezone.now()
    end = _floor_minute(now - ROLLUP_GRACE)
    start = cache.get(ROLLED_UP_TO_KEY)
    if start is None or start < end - ROLLUP_CATCHUP or start > end:
        start = end - ROLLUP_CATCHUP
    written = _rollup(start, end) if start < end else 0
    cache.set(ROLLED_UP_TO_KEY, end, timeout=None)
    return {"minutes": written, **gpu_telemetry_purge(now=now)}


def _rollup(start: dt.datetime, end: dt.datetime) -> int:
    means = (
        GpuSample.objects.filter(at__gte=start, at__lt=end)
        .annotate(minute=TruncMinute("at", tzinfo=dt.UTC))
        .values("node_id", "minute", "gpu")
        .annotate(**{name: Round(Avg(name)) for name in READINGS})
        .order_by()
    )
    rows = [
        GpuMinute(
            node_id=mean["node_id"],
            at=mean["minute"],
            gpu=mean["gpu"],
            **{name: None if mean[name] is None else int(mean[name]) for name in READINGS},
        )
        for mean in means.iterator(chunk_size=5000)
    ]
    with transaction.atomic():
        GpuMinute.objects.bulk_create(
            rows,
            batch_size=5000,
            update_conflicts=True,
            unique_fields=["node", "at", "gpu"],
            update_fields=list(READINGS),
        )
    return len(rows)


def gpu_telemetry_purge(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Delete samples past TELEMETRY_RAW_RETENTION_S and minutes past
    TELEMETRY_MINUTE_RETENTION_S: node by node, so each DELETE walks the primary key
    (node, at, ...) instead of scanning the table."""
    now = now or timezone.now()
    raw_before = now - dt.timedelta(seconds=settings.TELEMETRY_RAW_RETENTION_S)
    minute_before = now - dt.timedelta(seconds=settings.TELEMETRY_MINUTE_RETENTION_S)
    counts = {"samples_deleted": 0, "minutes_deleted": 0}
    # Every node that may have rows: a deleted node's rows went with it (CASCADE).
    node_ids = list(Node.objects.order_by("id").values_list("id", flat=True))
    for i in range(0, len(node_ids), PURGE_NODES_PER_STATEMENT):
        chunk = node_ids[i : i + PURGE_NODES_PER_STATEMENT]
        counts["samples_deleted"] += _delete_before(GpuSample, chunk, raw_before)
        counts["minutes_deleted"] += _delete_before(GpuMinute, chunk, minute_before)
    return counts


def _delete_before(model, node_ids: list[int], before: dt.datetime) -> int:
    # Nothing hangs off a reading and no signal listens: Django deletes in one statement.
    return model.objects.filter(node_id__in=node_ids, at__lt=before).delete()[0]
