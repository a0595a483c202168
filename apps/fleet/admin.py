"""Admin for the fleet. States change only through the services (drain, undrain)."""

from django.contrib import admin, messages

from apps.accounts.admin import AuditedAdmin, ReadOnlyAdmin
from apps.fleet import services
from apps.fleet.models import (
    Gpu,
    InstanceType,
    Node,
    NodeEvent,
    NodePool,
    OrphanInstance,
    Rack,
    Site,
)
from controlplane.errors import ApplicationError


@admin.register(Site)
class SiteAdmin(AuditedAdmin):
    create_service = services.site_create
    update_service = services.site_update
    delete_service = services.site_delete
    instance_kwarg = "site"
    list_display = ["name", "slug", "location"]
    search_fields = ["name", "slug"]


@admin.register(Rack)
class RackAdmin(AuditedAdmin):
    create_service = services.rack_create
    update_service = services.rack_update
    delete_service = services.rack_delete
    instance_kwarg = "rack"
    list_display = ["name", "site", "position", "height_units", "power_budget_kw"]
    list_filter = ["site"]


@admin.register(InstanceType)
class InstanceTypeAdmin(AuditedAdmin):
    create_service = services.instance_type_create
    update_service = services.instance_type_update
    delete_service = services.instance_type_delete
    instance_kwarg = "instance_type"
    list_display = ["name", "gpu_type", "gpu_count", "gpu_memory_gib", "vcpus", "network_gbps"]


@admin.register(NodePool)
class NodePoolAdmin(AuditedAdmin):
    create_service = services.pool_create
    update_service = services.pool_update
    delete_service = services.pool_delete
    instance_kwarg = "pool"
    service_m2m = frozenset({"instance_types"})
    list_display = [
        "name",
        "kind",
        "gpu_type",
        "site",
        "region",
        "fabric",
        "nccl_version",
        "enabled",
        "tenancy",
        "max_nodes",
    ]
    list_filter = ["kind", "gpu_type", "fabric", "enabled", "tenancy"]
    filter_horizontal = ["instance_types"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "name",
                    "slug",
                    "kind",
                    "gpu_type",
                    "site",
                    "region",
                    "instance_types",
                    "capacity_preference",
                    "min_nodes",
                    "max_nodes",
                    "enabled",
                    "tenancy",
                    "fabric",
                    "nccl_version",
                ]
            },
        ),
        (
            "Cloud: bursts, scale-down and orphans",
            {
                "fields": [
                    "burst_delay_s",
                    "idle_timeout_s",
                    "spot_interruption_limit",
                    "orphans",
                    "image_id",
                    "subnet_id",
                    "security_group_ids",
                    "key_name",
                    "instance_profile",
                ]
            },
        ),
    ]


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    readonly_fields = ["index", "uuid", "model", "memory_mib", "health", "health_reason"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Node)
class NodeAdmin(AuditedAdmin):
    create_service = services.node_create
    update_service = services.node_update
    delete_service = services.node_delete
    instance_kwarg = "node"
    list_display = [
        "name",
        "pool",
        "rack",
        "provider",
        "capacity_type",
        "state",
        "job_isolation",
        "last_heartbeat_at",
    ]
    list_filter = ["state", "provider", "capacity_type", "pool", "job_isolation"]
    search_fields = ["name", "address", "instance_id"]
    readonly_fields = [
        "uuid",
        "state",
        "state_reason",
        "state_changed_at",
        "suspect_from",
        "last_heartbeat_at",
        "job_isolation",
        "host_key_fingerprint",
        "offered_host_key",
        "burst_job",
        "placement_group",
        "launched_at",
        "interrupted_at",
    ]
    inlines = [GpuInline]
    actions = ["drain", "undrain"]

    @admin.action(description="Drain the selected nodes")
    def drain(self, request, queryset):
        self._each(
            request,
            queryset,
            lambda node: services.node_drain(
                node=node, reason=f"drained by {request.user} in the admin", by=request.user
            ),
        )

    @admin.action(description="Undrain the selected nodes")
    def undrain(self, request, queryset):
        self._each(
            request, queryset, lambda node: services.node_undrain(node=node, by=request.user)
        )

    def _each(self, request, queryset, operation):
        done = 0
        for node in queryset:
            try:
                operation(node)
                done += 1
            except ApplicationError as exc:
                self.message_user(request, f"{node}: {exc.message}", messages.WARNING)
        self.message_user(request, f"{done} node(s) updated.")


@admin.register(NodeEvent)
class NodeEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "node", "from_state", "to_state", "reason", "actor_label"]
    list_filter = ["to_state"]
    readonly_fields = [f.name for f in NodeEvent._meta.fields]


@admin.register(Gpu)
class GpuAdmin(AuditedAdmin):
    create_service = services.gpu_create
    update_service = services.gpu_update
    delete_service = services.gpu_delete
    instance_kwarg = "gpu"
    list_display = ["node", "index", "model", "memory_mib", "health"]
    list_filter = ["health", "model"]


@admin.register(OrphanInstance)
class OrphanInstanceAdmin(ReadOnlyAdmin):
    """What the orphan sweep found: instances with our tag that no node knows."""

    list_display = [
        "instance_id",
        "region",
        "pool_tag",
        "instance_type",
        "instance_state",
        "action",
        "first_seen_at",
        "last_seen_at",
        "gone_at",
    ]
    list_filter = ["action", "region"]
    search_fields = ["instance_id", "node_uuid", "pool_tag"]
    readonly_fields = [f.name for f in OrphanInstance._meta.fields]
