"""The usage ledger (append-only), its high-water marks, and the daily roll-ups reports read.

Ledger rows keep the ids of the node, pool, team and job they were metered for, with
no database constraint on them: the record of what was spent outlives the rows it
names (a node removed, a team renamed), and a job is referred to by its label only
(costs sits below jobs).
"""

from django.db import models

from apps.costs.money import MoneyField


class UsageKind(models.TextChoices):
    JOB = "job", "A job's GPUs"
    IDLE = "idle", "Idle GPUs"


def _loose(to: str, **extra) -> models.ForeignKey:
    """A reference kept as a plain id: no constraint, nothing cascades."""
    return models.ForeignKey(
        to, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", **extra
    )


class UsageEntry(models.Model):
    """Some GPUs of one node over [start, end): who used them, at which rate, what it cost.

    amount = rate per node-hour × hours × gpus / node_gpus. Rows are only ever
    added: a correction is another row (`corrects` names the row it adjusts).
    """

    id = models.BigAutoField(primary_key=True)
    node = _loose("fleet.Node")
    pool = _loose("fleet.NodePool")
    instance_type = _loose("fleet.InstanceType", null=True, blank=True)
    team = _loose("accounts.Team", null=True, blank=True)
    job = _loose("jobs.Job", null=True, blank=True)
    kind = models.CharField(max_length=4, choices=UsageKind.choices)
    capacity_type = models.CharField(max_length=10)
    gpus = models.PositiveSmallIntegerField()
    node_gpus = models.PositiveSmallIntegerField(
        help_text="What the node's cost is split over: its GPUs (or the GPUs held, if more)."
    )
    start = models.DateTimeField()
    end = models.DateTimeField()
    day = models.DateField(
        help_text="The day of `start` in COSTS_TIME_ZONE (rows never cross one)."
    )
    rate_per_hour = MoneyField(help_text="The node-hour rate in force.")
    amount = MoneyField()
    savings = MoneyField(default=0, help_text="Spot: the on-demand equivalent minus the amount.")
    power_w = models.PositiveIntegerField(null=True, blank=True, help_text="Owned nodes.")
    price_ref = models.CharField(max_length=60, help_text="The price-book rows that set the rate.")
    corrects = models.ForeignKey(
        "self",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        null=True,
        blank=True,
        related_name="corrections",
    )
    note = models.CharField(max_length=200, blank=True)
    recorded_at = models.DateTimeField()

    class Meta:
        ordering = ["start", "id"]
        indexes = [
            models.Index(fields=["day", "id"], name="usage_by_day"),
            models.Index(fields=["node", "end"], name="usage_by_node"),
            models.Index(
                fields=["job"], condition=models.Q(job__isnull=False), name="usage_by_job"
            ),
        ]

    def __str__(self) -> str:
        who = f"job {self.job_id}" if self.job_id else "idle"
        return f"node {self.node_id} {self.start:%Y-%m-%d %H:%M}: {who} {self.amount}"


class MeterMark(models.Model):
    """How far a node has been metered: advanced in the same transaction as its rows.

    `carry` is the exact remainder (a fraction of a nano-unit) not yet booked, so a
    node's rows add up to its exact cost rounded once, however many rows there are.
    `reprice_from`, set when a price behind the mark changes, asks the next metering
    run to correct what was booked since then.
    """

    node = models.OneToOneField(
        "fleet.Node",
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        primary_key=True,
        related_name="+",
    )
    metered_until = models.DateTimeField()
    carry = models.CharField(max_length=80, default="0")
    closed = models.BooleanField(
        default=False, help_text="Metered to its end (terminated): nothing more to meter."
    )
    reprice_from = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["reprice_from"],
                condition=models.Q(reprice_from__isnull=False),
                name="marks_to_reprice",
            )
        ]

    def __str__(self) -> str:
        return f"node {self.node_id} metered until {self.metered_until}"


class SpendTotals(models.Model):
    """What DailySpend and MonthlySpend add up per team, pool, capacity and instance type."""

    id = models.BigAutoField(primary_key=True)
    team_id = models.BigIntegerField(help_text="0: idle capacity.")
    pool_id = models.BigIntegerField()
    capacity_type = models.CharField(max_length=10)
    instance_type_id = models.BigIntegerField(help_text="0: none (owned).")
    amount = MoneyField(default=0)
    savings = MoneyField(default=0)
    gpu_seconds = models.BigIntegerField(default=0)

    class Meta:
        abstract = True


class DailySpend(SpendTotals):
    """One day's spend of one team (0: idle) on one pool, capacity type and instance type.

    Added to in the transaction that writes the ledger rows, so it always agrees with
    them; reports read these (a month is at most 31 rows per team and pool).
    """

    day = models.DateField()

    class Meta:
        ordering = ["day", "team_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["day", "team_id", "pool_id", "capacity_type", "instance_type_id"],
                name="daily_spend_once",
            )
        ]
        indexes = [models.Index(fields=["team_id", "day"], name="daily_spend_by_team")]

    def __str__(self) -> str:
        return f"{self.day} team {self.team_id} pool {self.pool_id}: {self.amount}"


class MonthlySpend(SpendTotals):
    """The same as DailySpend by month (in COSTS_TIME_ZONE), kept alongside it: a report
    over whole months reads a few thousand rows however busy the fleet was."""

    month = models.DateField(help_text="The first day of the month.")

    class Meta:
        ordering = ["month", "team_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["month", "team_id", "pool_id", "capacity_type", "instance_type_id"],
                name="monthly_spend_once",
            )
        ]
        indexes = [models.Index(fields=["team_id", "month"], name="monthly_spend_by_team")]

    def __str__(self) -> str:
        return f"{self.month:%Y-%m} team {self.team_id} pool {self.pool_id}: {self.amount}"


class JobDailySpend(models.Model):
    """One day's spend of one job: its cost so far, and the top jobs of a period."""

    id = models.BigAutoField(primary_key=True)
    day = models.DateField()
    job = _loose("jobs.Job")
    team_id = models.BigIntegerField()
    amount = MoneyField(default=0)
    gpu_seconds = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["day", "job_id"]
        constraints = [models.UniqueConstraint(fields=["job", "day"], name="job_daily_spend_once")]
        indexes = [models.Index(fields=["day", "team_id"], name="job_spend_by_day")]

    def __str__(self) -> str:
        return f"{self.day} job {self.job_id}: {self.amount}"
