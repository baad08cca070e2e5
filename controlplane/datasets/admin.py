"""Datasets admin: list with counts and status, an upload form that streams the file through
ingest_jsonl and shows the validation report, a read-only preview, and a DatasetRow admin that stays
fast on big tables (no full COUNT, no joins)."""
from django import forms
from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
import json

from .models import DESCRIPTION_MAX_CHARS, Dataset, DatasetRow
from .services import DatasetValidationError, ingest_jsonl, preview_rows

PREVIEW_ROWS = 20
PREVIEW_CHARS = 600


class DatasetUploadForm(forms.Form):
    file = forms.FileField(help_text="NeMo Gym JSONL: one JSON object per line with responses_create_params")
    name = forms.CharField(max_length=200, required=False, help_text="Default: the file name")
    description = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), required=False,
                                  max_length=DESCRIPTION_MAX_CHARS)
    accept_partial = forms.BooleanField(required=False, help_text="Keep the good rows when some lines are bad "
                                                                   "(otherwise a file with bad lines is rejected whole)")


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ("name", "status", "row_count", "bad_line_count", "size_display", "sha_short", "owner", "created_at")
    list_filter = ("status",)
    search_fields = ("name", "sha256", "source_filename")
    readonly_fields = ("status", "row_count", "bad_line_count", "size_bytes", "sha256", "source_filename",
                       "created_at", "report_display", "preview_display")
    fields = ("name", "description", "owner", "status", "row_count", "bad_line_count", "size_bytes", "sha256",
              "source_filename", "created_at", "report_display", "preview_display")
    change_list_template = "admin/datasets/dataset/change_list.html"

    def has_add_permission(self, request):
        return False  # datasets are created by uploading a file (the "Upload JSONL" button)

    @admin.display(description="size", ordering="size_bytes")
    def size_display(self, obj):
        n = obj.size_bytes
        for unit in ("B", "KiB", "MiB", "GiB"):
            if n < 1024 or unit == "GiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024

    @admin.display(description="sha256")
    def sha_short(self, obj):
        return obj.sha256[:12] if obj.sha256 else ""

    @admin.display(description="validation report")
    def report_display(self, obj):
        rep = obj.validation_report or {}
        if not rep:
            return "-"
        items = [(b["line"], b["reason"]) for b in rep.get("bad_lines", [])[:200]]
        more = rep.get("bad_line_count", 0) - len(items)
        return format_html(
            "<p>{}</p><ul>{}</ul>{}",
            rep.get("message", ""),
            format_html_join("", "<li>line {}: {}</li>", items),
            format_html("<p>… and {} more</p>", more) if more > 0 else "",
        )

    @admin.display(description=f"preview (first {PREVIEW_ROWS} rows)")
    def preview_display(self, obj):
        rows = preview_rows(obj, PREVIEW_ROWS)
        if not rows:
            return "-"
        items = []
        for r in rows:
            text = r["excerpt"] if r.get("truncated") else json.dumps(r["data"], ensure_ascii=False)
            if r.get("truncated") or len(text) > PREVIEW_CHARS:
                text = text[:PREVIEW_CHARS] + "…"
            items.append((r["index"], r["line_number"], text))
        rows_url = reverse("admin:datasets_datasetrow_changelist") + f"?dataset__id__exact={obj.pk}"
        return format_html(
            '<table><tr><th>index</th><th>line</th><th>row</th></tr>{}</table><p><a href="{}">All rows</a></p>',
            format_html_join("", "<tr><td>{}</td><td>{}</td><td><code>{}</code></td></tr>", items),
            rows_url,
        )

    def get_urls(self):
        return [
            path("upload/", self.admin_site.admin_view(self.upload_view), name="datasets_dataset_upload"),
            *super().get_urls(),
        ]

    def upload_view(self, request):
        if not self.has_view_or_change_permission(request) and not request.user.is_superuser:
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        report = None
        error = None
        if request.method == "POST":
            form = DatasetUploadForm(request.POST, request.FILES)
            if form.is_valid():
                f = form.cleaned_data["file"]
                name = form.cleaned_data["name"] or f.name
                try:
                    ds = ingest_jsonl(f, name=name, owner=request.user, accept_partial=form.cleaned_data["accept_partial"],
                                      source_filename=f.name, description=form.cleaned_data["description"])
                except DatasetValidationError as exc:
                    error = exc.message
                    report = exc.report
                else:
                    msg = f"Dataset '{ds.name}' loaded: {ds.row_count} rows, sha256 {ds.sha256[:12]}"
                    if ds.bad_line_count:
                        msg += f"; {ds.bad_line_count} bad line(s) skipped (see the report)"
                    self.message_user(request, msg, messages.SUCCESS if not ds.bad_line_count else messages.WARNING)
                    return redirect(reverse("admin:datasets_dataset_change", args=[ds.pk]))
        else:
            form = DatasetUploadForm()
        context = {
            **self.admin_site.each_context(request),
            "title": "Upload a NeMo Gym JSONL dataset",
            "opts": self.model._meta,
            "form": form,
            "error": error,
            "report": report,
            "bad_lines": (report or {}).get("bad_lines", [])[:1000],
        }
        return render(request, "admin/datasets/dataset/upload.html", context)


class CappedCountPaginator(Paginator):
    """COUNT(*) over a big table is slow on PostgreSQL: count at most CAP rows (LIMIT in a subquery)."""

    CAP = 100_000

    @cached_property
    def count(self):
        try:
            return self.object_list.values("pk")[: self.CAP + 1].count()
        except (AttributeError, TypeError):
            return len(self.object_list)


@admin.register(DatasetRow)
class DatasetRowAdmin(admin.ModelAdmin):
    list_display = ("dataset_id", "index", "line_number", "row_excerpt")
    list_filter = ()
    raw_id_fields = ("dataset",)
    readonly_fields = ("dataset", "index", "line_number", "pretty_data")
    fields = ("dataset", "index", "line_number", "pretty_data")
    paginator = CappedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    ordering = ("dataset", "index")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def lookup_allowed(self, lookup, value, request=None):
        return lookup in ("dataset__id__exact", "dataset") or super().lookup_allowed(lookup, value, request)

    @admin.display(description="row")
    def row_excerpt(self, obj):
        text = json.dumps(obj.data, ensure_ascii=False)
        return text[:200] + ("…" if len(text) > 200 else "")

    @admin.display(description="data")
    def pretty_data(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.data, indent=2, ensure_ascii=False))
