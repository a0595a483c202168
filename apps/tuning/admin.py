"""Admin for NCCL profiles: saves go through the services (the linter, the audit log)."""

from django.contrib import admin

from apps.accounts.admin import AuditedAdmin
from apps.tuning import services
from apps.tuning.models import NcclProfile


@admin.register(NcclProfile)
class NcclProfileAdmin(AuditedAdmin):
    create_service = services.nccl_profile_create
    update_service = services.nccl_profile_update
    delete_service = services.nccl_profile_delete
    instance_kwarg = "profile"
    list_display = ["name", "title", "fabric", "single_node", "min_nccl_version", "is_default"]
    list_filter = ["fabric", "single_node", "is_default", "built_in"]
    search_fields = ["name", "title"]
    readonly_fields = ["built_in", "created_at", "updated_at", "updated_by"]
