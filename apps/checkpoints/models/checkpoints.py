"""The registry: each checkpoint a trainer committed, each copy of it, and what became of them.

A checkpoint is registered when the trainer reports its commit (or when a sweep of the job's
directory finds a committed one whose report never came). Its copies are where its files
are: the directory the trainer wrote (on the node's own disk, or on storage every node
mounts) and an optional copy in S3. A checkpoint's state sums up its copies': verified when
one is, corrupt when none is usable; only GC moves it to deleting and, once storage says its
files are gone, to deleted.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone


class CheckpointState(models.TextChoices):
    # The bundled trainer reports commits only, so the registry never holds "writing" rows;
    # the state is kept for trainers that announce a checkpoint before committing it.
    WRITING = "writing", "Writing"
    COMMITTED = "committed", "Committed"  # reported; no copy checked yet
    VERIFIED = "verified", "Verified"  # a copy matched its manifest
    CORRUPT = "corrupt", "Corrupt"  # no copy left that can be used
    DELETING = "deleting", "Deleting"  # GC: its copies are being deleted from storage
    DELETED = "deleted", "Deleted"  # storage said every copy is gone


C = CheckpointState
LIVE_STATES = frozenset({C.COMMITTED, C.VERIFIED, C.CORRUPT})  # kept, not being collected


class CopyKind(models.TextChoices):
    NODE_LOCAL = "node_local", "Node-local"  # one node's disk: resumable on that node only
    SHARED = "shared", "Shared"  # a path every node mounts (CHECKPOINT_ROOT_SHARED)
    S3 = "s3", "S3"


class CopyState(models.TextChoices):
    COMMITTED = "committed", "Not checked yet"
    VERIFIED = "verified", "Verified"
    CORRUPT = "corrupt", "Corrupt"  # a file does not match the manifest
    MISSING = "missing", "Missing"  # gone from storage without GC deleting it
    FAILED = "failed", "Copy failed"  # never made (an upload that failed)
    DELETING = "deleting", "Deleting"
    DELETED = "deleted", "Deleted"


S = CopyState
# Files on storage, as far as the registry knows (deleting: not yet confirmed gone).
PRESENT_COPY_STATES = frozenset({S.COMMITTED, S.VERIFIED, S.CORRUPT})
ON_STORAGE_COPY_STATES = PRESENT_COPY_STATES | {S.DELETING}


class CopyRequest(models.TextChoices):
    NONE = "", "None"
    VERIFY = "verify", "Verify"
    DELETE = "delete", "Delete"


class Checkpoint(models.Model):
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.PROTECT, related_name="checkpoints")
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="+")
    attempt = models.PositiveSmallIntegerField(help_text="The attempt of the job that wrote it.")
    step = models.PositiveIntegerField()
    manifest_sha256 = models.CharField(max_length=64)
    world_size = models.PositiveIntegerField(default=1)
    layout = models.JSONField(default=dict, help_text="dp_replicate, dp_shard, tp, pp.")
    size_bytes = models.PositiveBigIntegerField(
        default=0, help_text="Every file, the manifest too."
    )
    files = models.PositiveIntegerField(default=0)
    loss = models.FloatField(null=True, blank=True)
    # The trainer's latest evaluation when it saved (its manifest's "eval"): what says which
    # checkpoint of a job is best. Null when the run did not evaluate.
    eval_loss = models.FloatField(null=True, blank=True, help_text="Held-out loss.")
    eval_perplexity = models.FloatField(null=True, blank=True)
    eval_step = models.PositiveIntegerField(
        null=True, blank=True, help_text="The step evaluated at (at most the checkpoint's)."
    )
    node = models.ForeignKey(
        "fleet.Node",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The node whose trainer (rank 0) committed it.",
    )
    s3_expected = models.BooleanField(
        default=False,
        help_text="Its run copies checkpoints to S3: older ones wait for this one's S3 copy.",
    )
    state = models.CharField(max_length=10, choices=CheckpointState.choices, default=C.COMMITTED)
    state_reason = models.CharField(max_length=300, blank=True)
    committed_at = models.DateTimeField(help_text="When the trainer committed it (its clock).")
    registered_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    offered_at = models.DateTimeField(
        null=True, blank=True, help_text="When a run plan last named it to resume from."
    )

    class Meta:
        ordering = ["job", "-step", "-committed_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "step", "manifest_sha256"], name="one_checkpoint_per_commit"
            ),
        ]
        indexes = [
            models.Index(fields=["job", "state", "step"]),
            models.Index(fields=["team", "state"]),
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.step}"


class CheckpointCopy(models.Model):
    id = models.BigAutoField(primary_key=True)
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="copies")
    kind = models.CharField(max_length=10, choices=CopyKind.choices)
    location = models.CharField(max_length=1024, help_text="A directory, or an s3:// URI.")
    node = models.ForeignKey(
        "fleet.Node",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="The node whose disk holds it (node-local copies only).",
    )
    state = models.CharField(max_length=10, choices=CopyState.choices, default=S.COMMITTED)
    error = models.CharField(max_length=500, blank=True)
    # What is asked of whoever can reach it (an agent, or the control plane for S3).
    request = models.CharField(
        max_length=10, choices=CopyRequest.choices, default=CopyRequest.NONE, blank=True
    )
    request_node = models.ForeignKey(
        "fleet.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_at = models.DateTimeField(null=True, blank=True)
    retry_after = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0, help_text="Failed deletions so far.")
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["checkpoint", "kind", "id"]
        constraints = [
            # One registered copy per place, while its files are there.
            models.UniqueConstraint(
                fields=["node", "location"],
                condition=Q(kind="node_local")
                & Q(state__in=["committed", "verified", "corrupt", "deleting"]),
                name="one_node_local_copy_per_path",
            ),
            models.UniqueConstraint(
                fields=["location"],
                condition=~Q(kind="node_local")
                & Q(state__in=["committed", "verified", "corrupt", "deleting"]),
                name="one_copy_per_path",
            ),
        ]
        indexes = [
            models.Index(
                fields=["request_node", "request"],
                condition=~Q(request=""),
                name="checkpoint_copy_requests",
            ),
            models.Index(fields=["kind", "state"]),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} copy of {self.checkpoint}"


class CheckpointEvent(models.Model):
    """One change of a checkpoint or of one of its copies: append-only."""

    id = models.BigAutoField(primary_key=True)
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="events")
    copy = models.ForeignKey(
        CheckpointCopy, null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    from_state = models.CharField(max_length=10, blank=True)
    to_state = models.CharField(max_length=10)
    reason = models.CharField(max_length=300)
    actor_label = models.CharField(max_length=150)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        what = f"copy {self.copy_id}" if self.copy_id else f"checkpoint {self.checkpoint_id}"
        return f"{what}: {self.from_state or '·'} → {self.to_state}"


class StorageSweep(models.Model):
    """A listing of a job's checkpoint directory by one node's agent, compared with the
    registry: committed directories without a row are registered, rows whose files are
    gone are marked so, and (with `tidy`) the trainer's abandoned temporaries removed."""

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="+")
    node = models.ForeignKey("fleet.Node", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=10, choices=CopyKind.choices)
    directory = models.CharField(max_length=1024)
    tidy = models.BooleanField(default=False)
    why = models.CharField(max_length=100)
    requested_at = models.DateTimeField(default=timezone.now)
    reported_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at", "-id"]
        indexes = [
            models.Index(
                fields=["node"], condition=Q(reported_at__isnull=True), name="open_sweeps"
            ),
            models.Index(fields=["job", "requested_at"]),
        ]

    def __str__(self) -> str:
        return f"sweep of {self.directory} on node {self.node_id}"
