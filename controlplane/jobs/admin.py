"""Admin for jobs: list with state and progress, cancel / pause / resume / retry failed actions (through
services), chunks inline, and a rollout list that stays fast on millions of rows."""
from __future__ import annotations

from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection
from django.utils.functional import cached_property

from . import services
from .models import CollectionJob, InvalidTransition, JobChunk, JobMetricSample, Rollout


class JobChunkInline(admin.TabularInline):
    model = JobChunk
    extra = 0
    can_delete = False
    fields = ("index", "start_row", "end_row", "state", "attempts", "lease_owner", "heartbeat_at", "dispatched_at",
              "started_at", "finished_at")
    readonly_fields = fields
    ordering = ("index",)

    def has_add_permission(self, request, obj=None):
        return False


def _job_action(service, verb):
    def action(modeladmin, request, queryset):
        done = 0
        for job in queryset:
            try:
                service(job)
                done += 1
            except InvalidTransition as exc:
                modeladmin.message_user(request, f"Job {job.pk}: {exc}", messages.WARNING)
            except ValidationError as exc:  # e.g. its endpoint's worker queue is a name the broker keeps
                modeladmin.message_user(request, f"Job {job.pk}: {'; '.join(exc.messages)}", messages.WARNING)
        if done:
            modeladmin.message_user(request, f"{verb} {done} job{'s' if done != 1 else ''}.", messages.SUCCESS)

    action.__name__ = f"{service.__name__}_action"
    return action


@admin.register(CollectionJob)
class CollectionJobAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "state", "progress", "completed_count", "failed_count", "stalled", "dataset",
                    "endpoint", "owner", "created_at")
    list_display_links = ("id", "name")
    list_filter = ("state", "stalled", "verifier")
    search_fields = ("name", "idempotency_key")
    list_select_related = ("dataset", "endpoint", "owner")
    raw_id_fields = ("owner", "dataset", "endpoint")
    inlines = [JobChunkInline]
    actions = [
        admin.action(description="Cancel selected jobs")(_job_action(services.cancel_job, "Cancelled")),
        admin.action(description="Pause selected jobs")(_job_action(services.pause_job, "Paused")),
        admin.action(description="Resume selected jobs")(_job_action(services.resume_job, "Resumed")),
        admin.action(description="Retry failed rollouts of selected jobs")(_job_action(services.retry_failed, "Retrying failed rows of")),
    ]
    # Only the name and the live parallelism are edited here; parameters are fixed once a job exists
    # (its chunks and totals were derived from them) and state changes go through the actions.
    readonly_fields = ("owner", "dataset", "endpoint", "state", "progress", "error_message", "stalled", "limit",
                       "num_repeats", "num_samples_in_parallel", "parallelism_auto", "responses_create_params",
                       "verifier", "verifier_options", "verify_mode", "chunk_size", "profiling_enabled",
                       "idempotency_key", "output_path", "total_rollouts", "completed_count", "failed_count",
                       "aggregate_metrics", "timing_summary", "created_at", "started_at", "finished_at",
                       "last_progress_at")
    fieldsets = (
        (None, {"fields": ("name", "owner", "dataset", "endpoint", "state", "progress", "error_message", "stalled")}),
        ("Parameters", {"fields": ("limit", "num_repeats", "num_samples_in_parallel", "parallelism_override",
                                   "parallelism_auto", "responses_create_params", "verifier", "verifier_options",
                                   "verify_mode", "chunk_size", "profiling_enabled", "idempotency_key", "output_path")}),
        ("Results", {"fields": ("total_rollouts", "completed_count", "failed_count", "aggregate_metrics", "timing_summary")}),
        ("Times", {"fields": ("created_at", "started_at", "finished_at", "last_progress_at")}),
    )

    @admin.display(description="progress")
    def progress(self, job):
        if not job.total_rollouts:
            return "-"
        return f"{job.done_count}/{job.total_rollouts} ({100 * job.progress_fraction:.0f}%)"

    def has_add_permission(self, request):
        return False  # jobs are created through the API, the dashboard or the CLI (create_job validates)


class LargeTablePaginator(Paginator):
    """COUNT(*) over millions of rows is slow on PostgreSQL: for the unfiltered list use the planner's
    estimate (pg_class.reltuples); filtered lists (e.g. one job, via its index) count for real."""

    @cached_property
    def count(self):
        qs = self.object_list
        if connection.vendor == "postgresql" and not qs.query.where:
            with connection.cursor() as cursor:
                cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE relname = %s", [qs.model._meta.db_table])
                row = cursor.fetchone()
            if row and row[0] and row[0] > 10000:
                return int(row[0])
        return super().count


class JobIdFilter(admin.SimpleListFilter):
    """?job=<id> for any job (uses the (job, id) index); the sidebar offers the most recent jobs only."""

    title = "job"
    parameter_name = "job"

    def lookups(self, request, model_admin):
        return [(str(pk), f"{pk} {name}".strip()) for pk, name in
                CollectionJob.objects.order_by("-id").values_list("pk", "name")[:15]]

    def queryset(self, request, queryset):
        value = self.value()
        if value and str(value).isdigit():
            return queryset.filter(job_id=int(value))
        return queryset


@admin.register(Rollout)
class RolloutAdmin(admin.ModelAdmin):
    list_display = ("id", "job_id", "task_index", "rollout_index", "status", "failure_class", "reward", "wall_ms",
                    "output_tokens", "worker", "created_at")
    list_filter = (JobIdFilter, "status")  # no DISTINCT scan over the table
    raw_id_fields = ("job",)
    list_select_related = ("job",)
    show_full_result_count = False
    paginator = LargeTablePaginator
    ordering = ("-id",)  # the primary key index; no sort on an unindexed column
    sortable_by = ("id",)
    search_fields = ()
    readonly_fields = [f.name for f in Rollout._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(JobMetricSample)
class JobMetricSampleAdmin(admin.ModelAdmin):
    list_display = ("id", "job_id", "worker", "t", "elapsed_s", "completed", "failed", "samples_per_s",
                    "output_tokens_per_s", "in_flight", "parallelism")
    list_filter = (JobIdFilter,)
    raw_id_fields = ("job",)
    show_full_result_count = False
    paginator = LargeTablePaginator
    ordering = ("-id",)
    sortable_by = ("id", "t")
    readonly_fields = [f.name for f in JobMetricSample._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
