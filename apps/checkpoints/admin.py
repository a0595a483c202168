"""Admin for checkpoints: the registry, its events and sweeps read-only (they follow what
storage says, through the services); S3 destinations through their services (ops)."""

from django.contrib import admin

from apps.accounts.admin import AuditedAdmin, ReadOnlyAdmin
from apps.checkpoints import services
from apps.checkpoints.models import (
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    S3Destination,
    StorageSweep,
)


class CopyInline(admin.TabularInline):
    model = CheckpointCopy
    extra = 0
    fields = ["kind", "location", "node", "state", "error", "request", "verified_at"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["job", "step", "state", "attempt", "size_bytes", "committed_at", "verified_at"]
    list_filter = ["state", "team"]
    search_fields = ["job__name", "manifest_sha256"]
    inlines = [CopyInline]


@admin.register(CheckpointEvent)
class CheckpointEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "checkpoint", "copy", "from_state", "to_state", "reason", "actor_label"]
    list_filter = ["to_state"]


@admin.register(StorageSweep)
class StorageSweepAdmin(ReadOnlyAdmin):
    list_display = ["job", "node", "directory", "why", "requested_at", "reported_at"]


@admin.register(S3Destination)
class S3DestinationAdmin(AuditedAdmin):
    create_service = services.s3_destination_create
    update_service = services.s3_destination_update
    delete_service = services.s3_destination_delete
    instance_kwarg = "destination"
    list_display = ["team", "pool", "bucket", "prefix", "updated_at"]
