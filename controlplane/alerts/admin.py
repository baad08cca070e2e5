from django.contrib import admin

from .models import Webhook, WebhookDelivery


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "endpoint", "name", "url", "enabled", "created_at"]
    exclude = ["secret"]


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ["id", "webhook", "event", "job", "state", "attempts", "response_status", "duration_ms", "created_at"]
    list_filter = ["state", "event"]
    readonly_fields = [f.name for f in WebhookDelivery._meta.fields]
