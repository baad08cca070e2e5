"""Dashboard-owned data: the heartbeat each Celery worker writes so the overview can show the fleet."""
from django.db import models


class WorkerHeartbeat(models.Model):
    """One row per Celery worker (its nodename), refreshed every few seconds by a thread the worker
    starts on `worker_ready` (see heartbeat.py). A worker is alive while `last_seen` is recent."""

    name = models.CharField(max_length=200, unique=True)  # celery nodename, e.g. celery@host
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_index=True)
    stopped = models.BooleanField(default=False)
    cpu_percent = models.FloatField(default=0)  # whole host
    cpu_count = models.PositiveIntegerField(default=0)
    process_cpu_percent = models.FloatField(default=0)
    memory_percent = models.FloatField(default=0)
    load_1m = models.FloatField(default=0)
    gpus = models.JSONField(default=list, blank=True)  # [{index, name, util_percent, mem_used_mb, mem_total_mb}]
    concurrency = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["host", "name"]

    def __str__(self):
        return self.name
