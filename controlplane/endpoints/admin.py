"""Endpoint admin: the API key is write-only (never rendered; blank on edit keeps the stored key),
with actions to check health and pre-warm."""
from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from .models import AdminOperation, Endpoint, WeightVersion
from .tasks import enqueue


class EndpointAdminForm(forms.ModelForm):
    base_url = forms.URLField(max_length=500, assume_scheme="http",
                              help_text="e.g. http://127.0.0.1:8000 (the /v1 prefix is added)")
    api_key = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="Write-only: never shown. Leave blank to keep the stored key.",
    )
    clear_api_key = forms.BooleanField(required=False, help_text="Remove the stored API key")

    class Meta:
        model = Endpoint
        fields = "__all__"

    def clean(self):
        data = super().clean()
        new_key = data.get("api_key") or ""
        if data.get("clear_api_key"):
            data["api_key"] = ""
        elif not new_key and self.instance and self.instance.pk:
            data["api_key"] = Endpoint.objects.filter(pk=self.instance.pk).values_list("api_key", flat=True).first() or ""
        return data


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin):
    form = EndpointAdminForm
    list_display = ("name", "model_name", "base_url", "api_flavor", "kind", "replicas", "key_set", "health", "last_health_at")
    list_filter = ("api_flavor", "kind")
    search_fields = ("name", "model_name", "base_url")
    readonly_fields = ("last_health_display", "last_health_at", "created_at")
    exclude = ("last_health",)
    actions = ["action_check_health", "action_prewarm"]
    fieldsets = (
        (None, {"fields": ("name", "owner", "kind", "base_url", "replica_urls", "model_name", "api_flavor",
                           "worker_queue")}),
        ("Credentials", {"fields": ("api_key", "clear_api_key")}),
        ("Limits", {"fields": ("request_timeout_s", "connect_timeout_s", "max_retries", "rpm_limit", "tpm_limit")}),
        ("Health", {"fields": ("last_health_display", "last_health_at", "created_at")}),
    )

    @admin.display(description="replicas")
    def replicas(self, obj):
        return len(obj.all_base_urls)

    @admin.display(boolean=True, description="API key")
    def key_set(self, obj):
        return bool(obj.api_key)

    @admin.display(description="health")
    def health(self, obj):
        if not obj.last_health:
            return "-"
        if obj.last_health.get("ok"):
            return mark_safe('<span style="color:green">ok</span>')
        return format_html('<span style="color:#b00">down</span>: {}', (obj.last_health.get("error") or "")[:120])

    @admin.display(description="last health check")
    def last_health_display(self, obj):
        h = obj.last_health or {}
        if not h:
            return "never checked"
        items = []
        for r in h.get("replicas", []):
            status = f"ok ({r.get('latency_ms')} ms)" if r.get("ok") else f"down: {r.get('error', '')}"
            items.append((r.get("url"), status))
        return format_html("<ul>{}</ul>", format_html_join("", "<li>{} — {}</li>", items))

    def _enqueue(self, request, queryset, kind, cap):
        # A worker calls the servers (never the web process); results land in last_health / last_prewarm.
        try:
            for ep in queryset[:cap]:
                enqueue(kind, ep)
        except Exception:  # noqa: BLE001 - broker down
            self.message_user(request, "the task queue is unavailable; try again shortly", messages.ERROR)
            return
        self.message_user(request, f"{kind} queued for {min(cap, queryset.count())} endpoint(s); reload to see "
                                   "the results", messages.SUCCESS)

    @admin.action(description="Check health of the selected endpoints")
    def action_check_health(self, request, queryset):
        self._enqueue(request, queryset, "health", 50)

    @admin.action(description="Pre-warm the selected endpoints (4 tiny requests)")
    def action_prewarm(self, request, queryset):
        self._enqueue(request, queryset, "prewarm", 20)


@admin.register(AdminOperation)
class AdminOperationAdmin(admin.ModelAdmin):
    """The ops log (read-only): search by trace id, filter by kind and status."""
    list_display = ("created_at", "trace_id", "endpoint", "kind", "replica", "status", "queue_ms", "rpc_ms", "wall_ms",
                    "attempts")
    list_filter = ("kind", "status", "source")
    search_fields = ("trace_id", "replica", "error")
    list_select_related = ("endpoint",)
    date_hierarchy = "created_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(WeightVersion)
class WeightVersionAdmin(admin.ModelAdmin):
    list_display = ("endpoint", "version", "previous_version", "weights_path", "checkpoint_id", "started_at",
                    "applied_at", "trace_id")
    search_fields = ("trace_id", "version", "checkpoint_id")
    list_select_related = ("endpoint",)
    readonly_fields = [f.name for f in WeightVersion._meta.fields]

    def has_add_permission(self, request):
        return False
