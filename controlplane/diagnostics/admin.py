from django.contrib import admin

from .models import ParallelismSweep


@admin.register(ParallelismSweep)
class ParallelismSweepAdmin(admin.ModelAdmin):
    list_display = ("id", "endpoint", "state", "recommended", "knee", "best_rollouts_per_s", "hint", "created_at")
    list_filter = ("state", "hint")
    readonly_fields = ("points", "interpretation", "stopped_reason", "error_message", "started_at", "finished_at")
