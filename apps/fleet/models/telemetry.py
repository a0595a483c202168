"""GPU telemetry kept over time: each heartbeat's readings (raw, for a day) and their
one-minute means (for a month).

Sized for 10,000 nodes of 8 GPUs heard every 15 s (the sweep's period): 80,000 rows
a flush. So a row is one GPU at one moment, in narrow columns (whole percent, °C,
watts, MiB), keyed by (node, at, gpu) with no surrogate id: the primary key is the
only index, and it serves both a node's charts and the retention purge (which deletes
node by node, `at` being the key's second column).
"""

from django.db import models


class GpuReading(models.Model):
    """One GPU's reading at one moment (abstract: the raw samples and the minutes share it)."""

    pk = models.CompositePrimaryKey("node", "at", "gpu")
    # No foreign-key constraint: a flush inserts 80,000 rows and checking each reference at
    # commit would cost more than the insert. Deleting a node removes its readings (one
    # DELETE: nothing hangs off a reading).
    node = models.ForeignKey(
        "fleet.Node",
        on_delete=models.CASCADE,
        related_name="+",
        db_constraint=False,
        db_index=False,  # the primary key starts with it
    )
    at = models.DateTimeField()
    gpu = models.SmallIntegerField()  # the GPU's index on its node
    utilization_pct = models.SmallIntegerField(null=True)
    memory_used_mib = models.IntegerField(null=True)
    temperature_c = models.SmallIntegerField(null=True)
    power_w = models.SmallIntegerField(null=True)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"node {self.node_id}/gpu{self.gpu} at {self.at:%Y-%m-%d %H:%M:%S}"


class GpuSample(GpuReading):
    """A heartbeat's reading, as the sweep wrote it (kept TELEMETRY_RAW_RETENTION_S)."""

    class Meta:
        ordering = ["node", "at", "gpu"]


class GpuMinute(GpuReading):
    """The mean of one minute's samples (`at` is the minute's start; kept
    TELEMETRY_MINUTE_RETENTION_S)."""

    class Meta:
        ordering = ["node", "at", "gpu"]
