from django.contrib import admin

from .models import WorkerHeartbeat


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(admin.ModelAdmin):
    list_display = ("name", "host", "last_seen", "stopped", "cpu_percent", "memory_percent", "concurrency")
