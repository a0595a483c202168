"""Data centres and the racks in them."""

from decimal import Decimal

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from apps.accounts.models import slug_validator


class Site(models.Model):
    name = models.CharField(max_length=100, unique=True)
    slug = models.CharField(max_length=50, unique=True, validators=[slug_validator])
    location = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Rack(models.Model):
    site = models.ForeignKey(Site, on_delete=models.PROTECT, related_name="racks")
    name = models.CharField(max_length=100)
    position = models.CharField(
        max_length=100, blank=True, help_text="Where it stands, e.g. 'hall 2, row B, slot 4'."
    )
    height_units = models.PositiveSmallIntegerField(
        default=42, validators=[MinValueValidator(1), MaxValueValidator(60)]
    )
    power_budget_kw = models.DecimalField(
        max_digits=7,
        decimal_places=2,
        validators=[MinValueValidator(Decimal("0.01"))],
        help_text="What the rack's feeds may draw, in kW.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["site__name", "name"]
        constraints = [models.UniqueConstraint(fields=["site", "name"], name="rack_name_per_site")]

    def __str__(self) -> str:
        return f"{self.site.slug}/{self.name}"
