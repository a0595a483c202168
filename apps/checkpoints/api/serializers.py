"""JSON shapes of checkpoints, their copies and events, jobs' checkpoint summaries, storage
used per team, and S3 destinations."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.accounts.selectors import teams_visible_to
from apps.checkpoints.models import (
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    CheckpointExport,
    ExportDtype,
    S3Destination,
)
from apps.fleet.selectors import pools_visible_to
from controlplane.api import ScopedPrimaryKeyField, StrictModelSerializer, StrictSerializer, Text


class CheckpointCopySerializer(StrictModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True, default=None, allow_null=True)
    job = serializers.IntegerField(source="checkpoint.job_id", read_only=True)
    step = serializers.IntegerField(source="checkpoint.step", read_only=True)

    class Meta:
        model = CheckpointCopy
        fields = [
            "id",
            "checkpoint",
            "job",
            "step",
            "kind",
            "location",
            "node",
            "state",
            "error",
            "request",
            "requested_at",
            "attempts",
            "created_at",
            "verified_at",
            "deleted_at",
        ]
        read_only_fields = fields


class CopyBriefSerializer(StrictModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True, default=None, allow_null=True)

    class Meta:
        model = CheckpointCopy
        fields = ["id", "kind", "location", "node", "state", "error", "verified_at"]
        read_only_fields = fields


class CheckpointEventSerializer(StrictModelSerializer):
    class Meta:
        model = CheckpointEvent
        fields = ["at", "copy", "from_state", "to_state", "reason", "actor_label"]
        read_only_fields = fields


class CheckpointSerializer(StrictModelSerializer):
    job_name = serializers.CharField(source="job.name", read_only=True)
    team_slug = serializers.CharField(source="team.slug", read_only=True)
    node = serializers.CharField(source="node.name", read_only=True, default=None, allow_null=True)
    copies = CopyBriefSerializer(many=True, read_only=True)
    best = serializers.SerializerMethodField(
        help_text="Its job's best checkpoint: the lowest eval_loss of its committed or verified "
        "ones (trainer.eval)."
    )

    class Meta:
        model = Checkpoint
        fields = [
            "id",
            "job",
            "job_name",
            "team",
            "team_slug",
            "attempt",
            "step",
            "state",
            "state_reason",
            "world_size",
            "layout",
            "size_bytes",
            "files",
            "loss",
            "eval_loss",
            "eval_perplexity",
            "eval_step",
            "best",
            "manifest_sha256",
            "node",
            "s3_expected",
            "committed_at",
            "registered_at",
            "verified_at",
            "deleted_at",
            "offered_at",
            "copies",
        ]
        read_only_fields = fields

    def get_best(self, checkpoint) -> bool:
        # best_id: annotated by the views (selectors.with_best); False where it was not.
        return getattr(checkpoint, "best_id", None) == checkpoint.pk


class CheckpointExportSerializer(StrictModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True, default=None, allow_null=True)
    requested_by = serializers.CharField(
        source="requested_by.username", read_only=True, default=None, allow_null=True
    )

    class Meta:
        model = CheckpointExport
        fields = [
            "id",
            "checkpoint",
            "state",
            "dtype",
            "source",
            "path",
            "node",
            "error",
            "files",
            "size_bytes",
            "requested_by",
            "requested_at",
            "finished_at",
        ]
        read_only_fields = fields


class ExportOptionsSerializer(StrictSerializer):
    dtype = serializers.ChoiceField(choices=ExportDtype.choices, default=ExportDtype.BFLOAT16)


class CheckpointDetailSerializer(CheckpointSerializer):
    events = CheckpointEventSerializer(many=True, read_only=True)
    exports = CheckpointExportSerializer(
        many=True, read_only=True, help_text="Exports to Hugging Face, newest first."
    )

    class Meta(CheckpointSerializer.Meta):
        fields = [*CheckpointSerializer.Meta.fields, "events", "exports"]
        read_only_fields = fields


class ReasonSerializer(StrictSerializer):
    reason = Text(max_length=300, required=False, allow_blank=True)


class CheckpointBriefSerializer(StrictSerializer):
    id = serializers.IntegerField()
    step = serializers.IntegerField()
    state = serializers.CharField()
    attempt = serializers.IntegerField()
    committed_at = serializers.DateTimeField()
    size_bytes = serializers.IntegerField()
    eval_loss = serializers.FloatField(allow_null=True, help_text="Held-out loss when saved.")
    eval_perplexity = serializers.FloatField(allow_null=True)
    eval_step = serializers.IntegerField(allow_null=True, help_text="The step evaluated at.")
    copies = serializers.ListField(child=serializers.DictField())


class WatchSerializer(StrictSerializer):
    overdue = serializers.BooleanField(
        help_text="Running, and no checkpoint verified for more than twice the expected interval."
    )
    reason = serializers.CharField()
    since = serializers.DateTimeField(
        allow_null=True, help_text="The newest verified checkpoint's commit, or the start if later."
    )
    age_s = serializers.FloatField(allow_null=True)
    expected_interval_s = serializers.FloatField(
        allow_null=True,
        help_text="checkpoint_every_steps × measured seconds per step, or "
        "checkpoint_every_minutes.",
    )


class RetentionSerializer(StrictSerializer):
    keep_last = serializers.IntegerField()
    keep_every = serializers.IntegerField(allow_null=True)
    final_step = serializers.IntegerField(allow_null=True)


class JobCheckpointsSerializer(StrictSerializer):
    id = serializers.IntegerField(source="job.pk")
    name = serializers.CharField(source="job.name")
    team = serializers.IntegerField(source="job.team_id")
    team_slug = serializers.CharField(source="job.team.slug")
    state = serializers.CharField(source="job.state")
    newest = serializers.SerializerMethodField()
    newest_verified = serializers.SerializerMethodField()
    best = serializers.SerializerMethodField(
        help_text="The lowest eval_loss of its committed or verified checkpoints; null when "
        "none was evaluated (trainer.eval)."
    )
    checkpoints = serializers.IntegerField(source="live_count", help_text="Kept (not deleted).")
    size_bytes = serializers.IntegerField(help_text="On storage, every copy counted.")
    watch = WatchSerializer()
    retention = serializers.SerializerMethodField()

    @extend_schema_field(CheckpointBriefSerializer(allow_null=True))
    def get_newest(self, row) -> dict | None:
        return self.context["summaries"][row.job.pk]["newest"]

    @extend_schema_field(CheckpointBriefSerializer(allow_null=True))
    def get_newest_verified(self, row) -> dict | None:
        return self.context["summaries"][row.job.pk]["newest_verified"]

    @extend_schema_field(CheckpointBriefSerializer(allow_null=True))
    def get_best(self, row) -> dict | None:
        return self.context["summaries"][row.job.pk]["best"]

    @extend_schema_field(RetentionSerializer)
    def get_retention(self, row) -> dict:
        return self.context["summaries"][row.job.pk]["retention"]


class StorageSerializer(StrictSerializer):
    team = serializers.IntegerField()
    team_slug = serializers.CharField()
    node_local = serializers.IntegerField(help_text="Bytes on nodes' own disks.")
    shared = serializers.IntegerField(help_text="Bytes on shared storage.")
    s3 = serializers.IntegerField(help_text="Bytes in S3.")
    total = serializers.IntegerField()
    copies = serializers.IntegerField()


class S3DestinationSerializer(StrictModelSerializer):
    team = ScopedPrimaryKeyField(selector=teams_visible_to, required=False, allow_null=True)
    pool = ScopedPrimaryKeyField(selector=pools_visible_to, required=False, allow_null=True)

    class Meta:
        model = S3Destination
        fields = ["id", "team", "pool", "bucket", "prefix", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]
        validators = []  # one per team or pool: the service checks (a 400 naming the field)

    def get_fields(self):
        fields = super().get_fields()
        if self.instance is not None:  # where a destination applies is fixed once made
            fields["team"].read_only = fields["pool"].read_only = True
        for name in ("team", "pool"):
            fields[name].validators = []
        return fields
