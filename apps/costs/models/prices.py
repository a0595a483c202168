"""The price book: what a node-hour costs, with the time each price takes effect.

A price row is never read as "the current price" alone: each has `effective_from`,
and an interval is priced by the row in force at each instant, so a change splits
the intervals that cross it. Rows can be edited (finance fixes a typo); what was
already metered at the old figure is corrected by new ledger rows, never rewritten.
"""

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class OwnedPrice(models.Model):
    """What one node of an owned pool costs per hour: amortised purchase, power, overhead.

    rate per node-hour = purchase_price / (depreciation_months × 730 h)
                       + power (kW) × pue × electricity_per_kwh
                       + overhead_per_month / 730 h
    with power the node's measured draw (heartbeats), else its nameplate, else
    `default_power_w`; per GPU-hour, divided by the node's GPUs.
    """

    pool = models.ForeignKey("fleet.NodePool", on_delete=models.PROTECT, related_name="+")
    effective_from = models.DateTimeField()
    purchase_price = models.DecimalField(
        max_digits=14, decimal_places=2, validators=[MinValueValidator(0)], help_text="Per node."
    )
    depreciation_months = models.PositiveSmallIntegerField(
        default=48, validators=[MinValueValidator(1), MaxValueValidator(240)]
    )
    electricity_per_kwh = models.DecimalField(
        max_digits=8, decimal_places=5, validators=[MinValueValidator(0)]
    )
    pue = models.DecimalField(
        max_digits=4,
        decimal_places=2,
        default=1.3,
        validators=[MinValueValidator(1), MaxValueValidator(5)],
        help_text="Power usage effectiveness of the data centre (1.0: no cooling overhead).",
    )
    overhead_per_month = models.DecimalField(
        max_digits=12,
        decimal_places=2,
        default=0,
        validators=[MinValueValidator(0)],
        help_text="Per node: support contracts, space, staff.",
    )
    default_power_w = models.PositiveIntegerField(
        default=10200,
        validators=[MaxValueValidator(100000)],
        help_text="Assumed draw of a node that reports none and has no nameplate power.",
    )
    source = models.CharField(max_length=500, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool_id", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "effective_from"], name="owned_price_once")
        ]

    def __str__(self) -> str:
        return f"owned price of pool {self.pool_id} from {self.effective_from:%Y-%m-%d %H:%M}"


class CloudPrice(models.Model):
    """A cloud instance type's on-demand list price in a region, per instance-hour."""

    instance_type = models.ForeignKey(
        "fleet.InstanceType", on_delete=models.PROTECT, related_name="+"
    )
    region = models.CharField(max_length=30)
    effective_from = models.DateTimeField()
    per_hour = models.DecimalField(
        max_digits=12, decimal_places=6, validators=[MinValueValidator(0)]
    )
    source = models.CharField(max_length=500, help_text="Where the figure came from, and when.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["instance_type_id", "region", "-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["instance_type", "region", "effective_from"], name="cloud_price_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.instance_type_id} in {self.region} from {self.effective_from:%Y-%m-%d}"


class PoolDiscount(models.Model):
    """A negotiated discount on a cloud pool's on-demand list prices (spot is not discounted)."""

    pool = models.ForeignKey("fleet.NodePool", on_delete=models.PROTECT, related_name="+")
    effective_from = models.DateTimeField()
    percent = models.DecimalField(
        max_digits=5, decimal_places=2, validators=[MinValueValidator(0), MaxValueValidator(100)]
    )
    source = models.CharField(max_length=500, blank=True, help_text="The agreement it comes from.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool_id", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "effective_from"], name="pool_discount_once")
        ]

    def __str__(self) -> str:
        return f"{self.percent}% off pool {self.pool_id} from {self.effective_from:%Y-%m-%d}"


class SpotPrice(models.Model):
    """A spot price as EC2's describe_spot_price_history reports it: in force from
    `effective_at` in one availability zone until the zone's next entry."""

    id = models.BigAutoField(primary_key=True)
    instance_type = models.ForeignKey(
        "fleet.InstanceType", on_delete=models.PROTECT, related_name="+"
    )
    region = models.CharField(max_length=30)
    availability_zone = models.CharField(max_length=40)
    effective_at = models.DateTimeField()
    per_hour = models.DecimalField(max_digits=12, decimal_places=6)
    fetched_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["instance_type_id", "region", "-effective_at", "availability_zone"]
        constraints = [
            models.UniqueConstraint(
                fields=["instance_type", "availability_zone", "effective_at"],
                name="spot_price_once",
            )
        ]
        indexes = [models.Index(fields=["instance_type", "region", "effective_at"])]

    def __str__(self) -> str:
        return f"{self.availability_zone} {self.per_hour} from {self.effective_at:%Y-%m-%d %H:%M}"
