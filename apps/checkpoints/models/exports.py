"""Exports of committed checkpoints as Hugging Face Llama directories, written by the agent of
a node that reaches the checkpoint (python -m workers.trainer.hf export, as the job's user)."""

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class ExportState(models.TextChoices):
    REQUESTED = "requested", "Requested"  # asked of a node's agent; its answer not yet in
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class ExportDtype(models.TextChoices):
    BFLOAT16 = "bfloat16", "bfloat16"
    FLOAT16 = "float16", "float16"
    FLOAT32 = "float32", "float32"


class CheckpointExport(models.Model):
    id = models.BigAutoField(primary_key=True)
    checkpoint = models.ForeignKey(
        "checkpoints.Checkpoint", on_delete=models.CASCADE, related_name="exports"
    )
    dtype = models.CharField(max_length=10, choices=ExportDtype.choices)
    source = models.CharField(max_length=1024, help_text="The checkpoint's directory read.")
    path = models.CharField(max_length=1024, help_text="The directory written, beside it.")
    node = models.ForeignKey(
        "fleet.Node",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The node whose agent was asked to write it.",
    )
    state = models.CharField(
        max_length=10, choices=ExportState.choices, default=ExportState.REQUESTED
    )
    error = models.CharField(max_length=500, blank=True)
    files = models.JSONField(default=list, blank=True, help_text="[{name, size}] written.")
    size_bytes = models.PositiveBigIntegerField(default=0)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    requested_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["checkpoint"],
                condition=Q(state="requested"),
                name="one_open_export_per_checkpoint",
            ),
        ]
        indexes = [
            models.Index(
                fields=["node"], condition=Q(state="requested"), name="open_checkpoint_exports"
            ),
        ]

    def __str__(self) -> str:
        return f"export of checkpoint {self.checkpoint_id} to {self.path}"
