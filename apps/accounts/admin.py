"""Admin for accounts. Writes go through the services, so the audit log sees them too."""

from django.contrib import admin, messages
from django.http import HttpResponseRedirect

from apps.accounts import services
from apps.accounts.forms import AdminSignInForm
from apps.accounts.models import (
    ApiToken,
    AuditEvent,
    Membership,
    OrgRole,
    ServiceAccount,
    Team,
    TeamQuota,
    TeamSecret,
)
from apps.accounts.services import audited_create, audited_delete, audited_update
from controlplane.errors import ApplicationError

# The admin's login page, throttled as the site's own is (apps/accounts/backends.py).
admin.site.login_form = AdminSignInForm


class AuditedAdmin(admin.ModelAdmin):
    """Saves and deletes through the app's services, as a page or the API would.

    `create_service`, `update_service` and `delete_service` name the services
    (`update_service` and `delete_service` take the object as `instance_kwarg`);
    without them the generic audited writes are used. A refusal becomes a message.
    """

    create_service = None
    update_service = None
    delete_service = None
    instance_kwarg = "instance"
    # Many-to-many fields the services take as arguments (so their rules apply).
    service_m2m: frozenset[str] = frozenset()

    def _action(self, verb: str) -> str:
        return f"{self.model._meta.model_name}.{verb}"

    def _m2m_names(self) -> set[str]:
        return {f.name for f in self.model._meta.many_to_many} - self.service_m2m

    def save_model(self, request, obj, form, change):
        m2m = self._m2m_names()
        try:
            if change:
                changes = {n: form.cleaned_data[n] for n in form.changed_data if n not in m2m}
                if type(self).update_service is not None:
                    saved = type(self).update_service(
                        by=request.user, **{self.instance_kwarg: obj}, **changes
                    )
                else:
                    saved = audited_update(
                        instance=obj,
                        by=request.user,
                        changes=changes,
                        action=self._action("update"),
                    )
            else:
                fields = {n: v for n, v in form.cleaned_data.items() if n not in m2m}
                if type(self).create_service is not None:
                    saved = type(self).create_service(by=request.user, **fields)
                else:
                    saved = audited_create(
                        model=type(obj),
                        by=request.user,
                        fields=fields,
                        action=self._action("create"),
                    )
            obj.pk = saved.pk
            obj.refresh_from_db()
        except ApplicationError as exc:
            self.message_user(request, f"{exc.message} {exc.details or ''}", messages.ERROR)
            raise _Refused from exc

    def save_related(self, request, form, formsets, change):
        if form.instance.pk is not None:
            super().save_related(request, form, formsets, change)

    def changeform_view(self, request, *args, **kwargs):
        try:
            return super().changeform_view(request, *args, **kwargs)
        except _Refused:
            return HttpResponseRedirect(request.path)

    def delete_model(self, request, obj):
        try:
            if type(self).delete_service is not None:
                type(self).delete_service(by=request.user, **{self.instance_kwarg: obj})
            else:
                audited_delete(instance=obj, by=request.user, action=self._action("delete"))
        except ApplicationError as exc:
            self.message_user(request, exc.message, messages.ERROR)

    def delete_queryset(self, request, queryset):
        for obj in queryset:
            self.delete_model(request, obj)


class _Refused(Exception):
    """A service said no while the admin saved: show its message, write nothing."""


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
    create_service = services.team_create
    update_service = services.team_update
    delete_service = services.team_delete
    instance_kwarg = "team"
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
    create_service = services.membership_create
    update_service = services.membership_update
    delete_service = services.membership_delete
    instance_kwarg = "membership"

    def get_readonly_fields(self, request, obj=None):
        # A membership changes only its role; another user or team is another membership.
        return ["user", "team"] if obj is not None else []


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
        "parent",
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


@admin.register(TeamSecret)
class TeamSecretAdmin(admin.ModelAdmin):
    """Names only: values are set through the API and never shown."""

    list_display = ["name", "team", "updated_at"]
    fields = ["team", "name", "created_by", "created_at", "updated_at"]
    readonly_fields = fields

    def has_add_permission(self, request):
        return False

    def delete_model(self, request, obj):
        services.team_secret_delete(secret=obj, by=request.user)

    def delete_queryset(self, request, queryset):
        for secret in queryset:
            services.team_secret_delete(secret=secret, by=request.user)
