"""Admin for accounts. Writes go through the services, so the audit log sees them too."""

from django.contrib import admin, messages

from apps.accounts import services
from apps.accounts.models import (
    ApiToken,
    AuditEvent,
    Membership,
    OrgRole,
    ServiceAccount,
    Team,
    TeamQuota,
)
from apps.accounts.services import audited_create, audited_delete, audited_update, snapshot
from controlplane.errors import ApplicationError


class AuditedAdmin(admin.ModelAdmin):
    """Saves and deletes through the audited service functions, as a page or the API would."""

    def _action(self, verb: str) -> str:
        return f"{self.model._meta.model_name}.{verb}"

    def save_model(self, request, obj, form, change):
        try:
            if change:
                changes = {
                    name: getattr(obj, name)
                    for name in form.changed_data
                    if name not in self._m2m_names()
                }
                saved = audited_update(
                    instance=obj, by=request.user, changes=changes, action=self._action("update")
                )
                obj.pk = saved.pk
            else:
                fields = {
                    f.name: getattr(obj, f.name)
                    for f in obj._meta.concrete_fields
                    if not f.auto_created and f.editable and not f.primary_key
                }
                created = audited_create(
                    model=type(obj), by=request.user, fields=fields, action=self._action("create")
                )
                obj.pk = created.pk
        except ApplicationError as exc:
            self.message_user(request, f"{exc.message} {exc.details or ''}", messages.ERROR)

    def _m2m_names(self) -> set[str]:
        return {f.name for f in self.model._meta.many_to_many}

    def delete_model(self, request, obj):
        try:
            audited_delete(instance=obj, by=request.user, action=self._action("delete"))
        except ApplicationError as exc:
            self.message_user(request, exc.message, messages.ERROR)

    def delete_queryset(self, request, queryset):
        for obj in queryset:
            self.delete_model(request, obj)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Append-only records: visible, never edited or deleted here."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class QuotaInline(admin.TabularInline):
    model = TeamQuota
    extra = 0

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Team)
class TeamAdmin(AuditedAdmin):
    list_display = ["name", "slug", "created_at"]
    search_fields = ["name", "slug"]
    inlines = [QuotaInline]


@admin.register(TeamQuota)
class TeamQuotaAdmin(AuditedAdmin):
    list_display = ["team", "gpu_type", "max_gpus"]
    list_filter = ["gpu_type"]


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    list_display = ["user", "team", "role", "created_at"]
    list_filter = ["role", "team"]
    search_fields = ["user__username", "team__slug"]


@admin.register(OrgRole)
class OrgRoleAdmin(AuditedAdmin):
    list_display = ["user", "role", "created_at"]
    list_filter = ["role"]


@admin.register(ServiceAccount)
class ServiceAccountAdmin(AuditedAdmin):
    list_display = ["name", "team", "user", "created_at"]
    readonly_fields = ["user", "created_by"]

    def has_add_permission(self, request):
        return False  # made through the API, which creates the robot user with it


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "scopes", "expires_at", "last_used_at", "revoked_at"]
    list_filter = ["revoked_at"]
    readonly_fields = [
        "user",
        "name",
        "prefix",
        "scopes",
        "created_by",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False  # the secret is shown once, by the API that makes it

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request, queryset):
        for token in queryset:
            services.api_token_revoke(token=token, by=request.user)
        self.message_user(request, f"Revoked {queryset.count()} token(s).")


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "actor_label", "channel", "action", "object_repr", "address"]
    list_filter = ["channel", "action"]
    search_fields = ["object_repr", "actor_label", "object_id"]
    readonly_fields = [f.name for f in AuditEvent._meta.fields]


__all__ = ["AuditedAdmin", "ReadOnlyAdmin", "snapshot"]
