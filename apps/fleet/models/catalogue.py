"""Cloud instance types and their published hardware facts."""

from django.core.validators import MinValueValidator
from django.db import models

from apps.accounts.models import GPU_TYPES


class InstanceType(models.Model):
    name = models.CharField(max_length=50, unique=True)
    gpu_type = models.CharField(max_length=10, choices=GPU_TYPES)
    gpu_count = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    gpu_memory_gib = models.PositiveIntegerField(help_text="Per GPU.")
    vcpus = models.PositiveIntegerField()
    memory_gib = models.PositiveIntegerField()
    network_gbps = models.PositiveIntegerField(help_text="EFA bandwidth per instance.")
    local_nvme_tb = models.DecimalField(max_digits=6, decimal_places=2, default=0)
    source = models.URLField(blank=True, help_text="Where the facts were published.")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
