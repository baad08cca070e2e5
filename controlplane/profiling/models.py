"""Profiling of a job: sessions ("profile for N seconds", switched on while the job runs) and the snapshots
workers send (one time window of one worker: one row per function with the profiler's columns)."""
from django.conf import settings
from django.db import models
from django.utils import timezone


class ProfileSession(models.Model):
    class Scope(models.TextChoices):
        VERIFY = "verify", "verification (verifier processes)"
        WORKER = "worker", "whole worker"

    class Clock(models.TextChoices):
        WALL = "wall"
        CPU = "cpu"

    job = models.ForeignKey("jobs.CollectionJob", on_delete=models.CASCADE, related_name="profile_sessions")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    scope = models.CharField(max_length=10, choices=Scope.choices, default=Scope.VERIFY)
    clock = models.CharField(max_length=10, choices=Clock.choices, default=Clock.WALL)
    budget_pct = models.FloatField(default=2.0, help_text="verification scope: throughput cost the sampling aims at")
    window_s = models.FloatField(default=5.0, help_text="one snapshot per worker per window")
    seconds = models.FloatField(null=True, blank=True, help_text="profile for this long (empty: until switched off)")
    stats_urls = models.JSONField(default=list, blank=True,
                                  help_text="NeMo Gym servers' /stats URLs pulled into the same rows")
    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    until = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-pk"]

    def __str__(self):
        return f"profile #{self.pk} of job {self.job_id} ({self.scope}, {self.clock})"

    @property
    def active(self) -> bool:
        now = timezone.now()
        return self.stopped_at is None and (self.until is None or self.until > now)

    @property
    def key(self) -> str:
        return f"job{self.job_id}-p{self.pk}"


class ProfileSnapshot(models.Model):
    session = models.ForeignKey(ProfileSession, on_delete=models.CASCADE, related_name="snapshots")
    job = models.ForeignKey("jobs.CollectionJob", on_delete=models.CASCADE, related_name="profile_snapshots")
    worker = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=40, default="yappi", help_text="yappi, or nemo-gym:<url> for a /stats pull")
    window_start = models.DateTimeField()
    window_end = models.DateTimeField(db_index=True)
    verifications = models.PositiveIntegerField(default=0)
    profiled = models.PositiveIntegerField(default=0)
    overhead_pct = models.FloatField(null=True, blank=True)
    total_s = models.FloatField(default=0.0, help_text="profiled time: the sum of tsub over the rows")
    final = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-window_end", "-pk"]


class ProfileRow(models.Model):
    snapshot = models.ForeignKey(ProfileSnapshot, on_delete=models.CASCADE, related_name="rows")
    module = models.CharField(max_length=500)
    line = models.IntegerField(default=0)
    name = models.CharField(max_length=300)
    ncall = models.FloatField()
    tsub = models.FloatField()
    ttot = models.FloatField()
    tavg = models.FloatField()
    children = models.JSONField(default=list, blank=True, help_text="[[module, line, name, ncall, ttot], ...]")

    class Meta:
        indexes = [models.Index(fields=["snapshot", "ttot"])]
