"""Parallelism sweeps (the profiling guide's quick diagnostic, automated) stored with their curve."""
from django.conf import settings
from django.db import models
from django.utils import timezone


class ParallelismSweep(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="parallelism_sweeps")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.CASCADE, related_name="sweeps")
    dataset = models.ForeignKey("datasets.Dataset", null=True, blank=True, on_delete=models.SET_NULL, related_name="sweeps")
    job = models.ForeignKey("jobs.CollectionJob", null=True, blank=True, on_delete=models.SET_NULL, related_name="sweeps",
                            help_text="The job whose settings (verifier, sampling overrides) the sweep reused")
    sample_size = models.PositiveIntegerField(default=64, help_text="Dataset rows in the sample (cycled at every level)")
    levels = models.JSONField(default=list, blank=True, help_text="Parallelism levels; empty = 1, 2, 4 ... max_parallelism")
    start_parallelism = models.PositiveIntegerField(default=1)
    max_parallelism = models.PositiveIntegerField(default=512)
    verifier = models.CharField(max_length=50, default="math")
    verifier_options = models.JSONField(default=dict, blank=True)
    verify_mode = models.CharField(max_length=20, default="inline")
    responses_create_params = models.JSONField(default=dict, blank=True)

    state = models.CharField(max_length=20, choices=State.choices, default=State.QUEUED, db_index=True)
    points = models.JSONField(default=list, blank=True, help_text="[{parallelism, rollouts_per_s, p50_ms, p99_ms, error_rate, ...}]")
    knee = models.PositiveIntegerField(null=True, blank=True)
    recommended = models.PositiveIntegerField(null=True, blank=True)
    best_rollouts_per_s = models.FloatField(null=True, blank=True)
    speedup = models.FloatField(null=True, blank=True)
    hint = models.CharField(max_length=40, blank=True)
    interpretation = models.TextField(blank=True)
    stopped_reason = models.CharField(max_length=300, blank=True)
    error_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"sweep {self.pk} on {self.endpoint_id} [{self.state}] -> {self.recommended}"

    @property
    def peak_parallelism(self) -> int:
        """The most requests it runs at once (what counts against the owner's parallelism quota)."""
        return max([self.max_parallelism, *[int(x) for x in (self.levels or []) if isinstance(x, int)]])

    def as_result_dict(self) -> dict:
        """The shape of workers.sweep.SweepResult.to_dict(), for the classifier's evidence."""
        return {"points": self.points, "knee": self.knee, "recommended": self.recommended, "hint": self.hint,
                "speedup": self.speedup, "interpretation": self.interpretation}

    def mark(self, state, **fields):
        self.state = state
        if state == self.State.RUNNING:
            fields.setdefault("started_at", timezone.now())
        elif state in (self.State.COMPLETED, self.State.FAILED, self.State.CANCELLED):
            fields.setdefault("finished_at", timezone.now())
        for k, v in fields.items():
            setattr(self, k, v)
        self.save(update_fields=["state", *fields.keys()])
