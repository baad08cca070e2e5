"""Datasets: NeMo Gym task files, validated while streaming and stored row by row."""
from django.conf import settings
from django.db import models


DESCRIPTION_MAX_CHARS = 2000


class Dataset(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        READY = "ready"
        REJECTED = "rejected"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="datasets")
    name = models.CharField(max_length=200)
    description = models.CharField(max_length=DESCRIPTION_MAX_CHARS, blank=True)
    source_filename = models.CharField(max_length=500, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.VALIDATING)
    row_count = models.PositiveIntegerField(default=0)
    bad_line_count = models.PositiveIntegerField(default=0)
    size_bytes = models.PositiveBigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    # {"bad_lines": [{"line": 7, "reason": "..."}...], "truncated": bool, "accepted_partial": bool}
    validation_report = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} ({self.row_count} rows)"


class DatasetRow(models.Model):
    """One task. (dataset, index) is unique and indexed, so any range of rows reads cheaply."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="rows")
    index = models.PositiveIntegerField()  # 0-based position among the dataset's good rows
    line_number = models.PositiveIntegerField()  # 1-based line in the uploaded file
    data = models.JSONField()
    # NeMo Gym's task index (the row's own `_ng_task_index`, else shared by identical lines) and how many
    # earlier rows had it: the row's rollouts are occurrence*R .. occurrence*R+R-1 (workers/task_index.py).
    # NULL on rows stored before: their task index is `_ng_task_index` or `index`, occurrence 0.
    task_index = models.PositiveIntegerField(null=True)
    occurrence = models.PositiveIntegerField(default=0)
    # 16-byte digest of the line (NULL when the row carries its own index): identical lines are found by the
    # database after ingest, so ingest memory does not grow with the file
    line_digest = models.BinaryField(null=True, editable=False)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "index"], name="uniq_dataset_row_index")]
        ordering = ["dataset", "index"]
