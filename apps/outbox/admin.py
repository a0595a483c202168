from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.outbox.models import WebhookCall


@admin.register(WebhookCall)
class WebhookCallAdmin(ReadOnlyAdmin):
    list_display = ["topic", "source", "team", "state", "attempts", "next_attempt_at", "created_at"]
    list_filter = ["topic", "state"]
    exclude = ["signing_key"]
