"""Admin for jobs: states change only through the services (cancel, hold, release)."""

from django.contrib import admin, messages

from apps.accounts.admin import ReadOnlyAdmin
from apps.jobs import services
from apps.jobs.models import Allocation, Job, JobEvent, Reservation, TeamUsage
from controlplane.errors import ApplicationError


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    readonly_fields = ["at", "from_state", "to_state", "reason", "actor_label"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Jobs are submitted through the API, the CLI or the Submit page, where the spec is checked."""

    list_display = [
        "id",
        "name",
        "team",
        "state",
        "priority_class",
        "gpu_type",
        "nodes",
        "gpus_per_node",
        "pool",
        "submitted_at",
    ]
    list_filter = ["state", "priority_class", "gpu_type", "team"]
    search_fields = ["name", "uuid"]
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [JobEventInline]
    actions = ["cancel", "hold", "release"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def _each(self, request, queryset, operation):
        done = 0
        for job in queryset:
            try:
                operation(job=job, by=request.user)
                done += 1
            except ApplicationError as exc:
                self.message_user(request, f"{job}: {exc.message}", messages.WARNING)
        self.message_user(request, f"{done} job(s) updated.")

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request, queryset):
        self._each(request, queryset, services.job_cancel)

    @admin.action(description="Hold the selected jobs")
    def hold(self, request, queryset):
        self._each(request, queryset, services.job_hold)

    @admin.action(description="Release the selected jobs")
    def release(self, request, queryset):
        self._each(request, queryset, services.job_release)


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "job", "from_state", "to_state", "reason", "actor_label"]
    list_filter = ["to_state"]
    readonly_fields = [f.name for f in JobEvent._meta.fields]


@admin.register(Allocation)
class AllocationAdmin(ReadOnlyAdmin):
    list_display = ["job", "node", "gpus", "started_at", "ended_at"]
    readonly_fields = [f.name for f in Allocation._meta.fields]


@admin.register(TeamUsage)
class TeamUsageAdmin(ReadOnlyAdmin):
    list_display = ["team", "scaled_gpu_seconds", "updated_at"]
    readonly_fields = [f.name for f in TeamUsage._meta.fields]


@admin.register(Reservation)
class ReservationAdmin(admin.ModelAdmin):
    """Reservations are made through the API (which checks and audits them); shown here."""

    list_display = ["name", "team", "starts_at", "ends_at", "reason"]
    readonly_fields = [
        "name",
        "team",
        "reason",
        "nodes",
        "starts_at",
        "ends_at",
        "created_by",
        "created_at",
    ]

    def has_add_permission(self, request):
        return False

    def delete_model(self, request, obj):
        services.reservation_delete(reservation=obj, by=request.user)

    def delete_queryset(self, request, queryset):
        for reservation in queryset:
            services.reservation_delete(reservation=reservation, by=request.user)
