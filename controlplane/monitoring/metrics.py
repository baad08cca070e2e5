"""The control plane's own Prometheus metrics.

Two kinds, so every figure is right with several web and worker processes on several hosts:
* events (rollouts stored by outcome, failures by class, chunk lease lag, chunk run outcomes, write-batch
  latency) are counters / histograms recorded where they happen, in prometheus-client's multi-process
  mode: each process writes its own mmap file under settings.PROMETHEUS_MULTIPROC_DIR and a scrape sums
  every file there (processes that exited included, so counters never go back). The directory is emptied
  when a deployment starts (scripts/demo.sh, the compose `migrate` service), never by a running process.
* states (jobs by state, chunks, stale leases, live workers) are read from the database at scrape time
  (DatabaseCollector): the same answer whichever web process is scraped.
"""
from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

from django.conf import settings
from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

logger = logging.getLogger(__name__)

MULTIPROC_DIR = str(settings.PROMETHEUS_MULTIPROC_DIR)
os.makedirs(MULTIPROC_DIR, exist_ok=True)
# prometheus-client reads the directory from the environment when a value is created; processes this one
# starts (verifier pools) inherit it.
os.environ["PROMETHEUS_MULTIPROC_DIR"] = MULTIPROC_DIR


def _process_identifier() -> str:
    """Unique among processes sharing the directory: containers of one compose project may share a volume
    and each has its own pid 1, so the host name goes in too ('_' separates fields in the file name)."""
    return f"{socket.gethostname().replace('_', '-')}-{os.getpid()}"


# Always ours (with the host name), even when prometheus-client chose os.getpid from the environment at import.
values.ValueClass = values.MultiProcessValue(process_identifier=_process_identifier)

# Not registered in the default registry: a scrape builds its own from the files (multi-process rule).
_NO_REGISTRY = None

ROLLOUTS = Counter("controlplane_rollouts", "Rollouts stored (each (job, task, repeat) once: duplicates from a "
                   "re-run chunk are not counted), by outcome; rate() gives rollouts/s",
                   ["outcome"], registry=_NO_REGISTRY)
ROLLOUT_FAILURES = Counter("controlplane_rollout_failures", "Failed rollouts stored, by failure class "
                           "(http_429, http_5xx, timeout, connection, verifier_error, ...)",
                           ["failure_class"], registry=_NO_REGISTRY)
CHUNK_RUNS = Counter("controlplane_chunk_runs", "Chunk runs ended, by outcome (done, failed, paused, cancelled, "
                     "lost_lease, incomplete; busy: another worker held it, e.g. a duplicate message or the CLI "
                     "waiting; skipped: already done or the job not runnable)", ["outcome"], registry=_NO_REGISTRY)
CHUNK_LEASE_LAG = Histogram("controlplane_chunk_lease_lag_seconds", "Time from a chunk's dispatch to a worker "
                            "taking its lease", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
                            registry=_NO_REGISTRY)
WRITE_BATCH_SECONDS = Histogram("controlplane_write_batch_seconds", "Latency of one batched database write "
                                "(rollout insert + job counters + heartbeat; verification reward updates)",
                                ["kind"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                registry=_NO_REGISTRY)
WRITE_BATCH_ROWS = Counter("controlplane_write_batch_rows", "Rows handed to batched database writes", ["kind"],
                           registry=_NO_REGISTRY)


def record_rollout_batch(seconds: float, rows: int, ok: int, failed_by_class: dict[str, int]) -> None:
    """After a committed batch of rollouts: what was really inserted, and how long the write took."""
    WRITE_BATCH_SECONDS.labels("rollouts").observe(seconds)
    WRITE_BATCH_ROWS.labels("rollouts").inc(rows)
    if ok:
        ROLLOUTS.labels("ok").inc(ok)
    failed = sum(failed_by_class.values())
    if failed:
        ROLLOUTS.labels("failed").inc(failed)
    for failure_class, n in failed_by_class.items():
        ROLLOUT_FAILURES.labels(failure_class or "unknown").inc(n)


def record_verify_batch(seconds: float, rows: int) -> None:
    WRITE_BATCH_SECONDS.labels("verify").observe(seconds)
    WRITE_BATCH_ROWS.labels("verify").inc(rows)


def record_lease_taken(dispatched_at, taken_at) -> None:
    """A worker took a chunk's lease; dispatched_at is None for chunks the CLI runs in its own process."""
    if dispatched_at is not None:
        CHUNK_LEASE_LAG.observe(max(0.0, (taken_at - dispatched_at).total_seconds()))


def record_chunk_run(outcome: str) -> None:
    CHUNK_RUNS.labels(outcome).inc()


# --- state read from the database when scraped ---------------------------------------------------------
class DatabaseCollector:
    """Gauges computed per scrape from a few aggregate queries on small tables (jobs, chunks, heartbeats;
    never a count over the rollouts table). A database error gives controlplane_database_up 0, not a 500."""

    def collect(self):
        from django.db.models import Count, Max, Min, Q, Sum
        from django.utils import timezone

        from controlplane.dashboard.heartbeat import alive_workers
        from controlplane.jobs.models import CollectionJob, JobChunk, JobState

        up = GaugeMetricFamily("controlplane_database_up", "1 when the database answered this scrape's queries")
        try:
            now = timezone.now()
            jobs = dict(CollectionJob.objects.values_list("state").annotate(n=Count("id")).order_by())
            stalled = CollectionJob.objects.filter(state=JobState.RUNNING, stalled=True).count()
            stored = CollectionJob.objects.aggregate(ok=Sum("completed_count"), failed=Sum("failed_count"))
            chunks = dict(JobChunk.objects.values_list("state").annotate(n=Count("id")).order_by())
            stale_before = now - timedelta(seconds=settings.JOBS_LEASE_TIMEOUT_S)
            running = JobChunk.objects.filter(state=JobChunk.State.RUNNING).aggregate(
                stale=Count("id", filter=Q(heartbeat_at__lt=stale_before) | Q(heartbeat_at__isnull=True)),
                oldest=Min("heartbeat_at"))
            waiting = JobChunk.objects.filter(state=JobChunk.State.PENDING, job__state__in=JobState.RUNNABLE,
                                              dispatched_at__isnull=False).aggregate(oldest=Min("dispatched_at"),
                                                                                     n=Count("id"))
            workers = alive_workers().aggregate(n=Count("id"), slots=Sum("concurrency"), last=Max("last_seen"))
        except Exception as exc:  # noqa: BLE001 - a scrape reports the outage instead of failing
            logger.warning("metrics: database figures unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up

        g = GaugeMetricFamily("controlplane_jobs", "Collection jobs by state", labels=["state"])
        for state in JobState:
            g.add_metric([state.value], jobs.get(state.value, 0))
        yield g
        yield GaugeMetricFamily("controlplane_jobs_stalled", "Running jobs flagged stalled (no progress for "
                                "JOBS_STALL_AFTER_S)", value=stalled)
        g = GaugeMetricFamily("controlplane_rollouts_stored", "Rollouts stored over all jobs (the jobs' counters), "
                              "by outcome", labels=["outcome"])
        g.add_metric(["ok"], stored["ok"] or 0)
        g.add_metric(["failed"], stored["failed"] or 0)
        yield g
        g = GaugeMetricFamily("controlplane_chunks", "Job chunks by state", labels=["state"])
        for state in JobChunk.State:
            g.add_metric([state.value], chunks.get(state.value, 0))
        yield g
        yield GaugeMetricFamily("controlplane_chunk_leases_stale", "Running chunks whose worker has not "
                                "heartbeated for JOBS_LEASE_TIMEOUT_S (the watchdog hands them out again)",
                                value=running["stale"] or 0)
        oldest = running["oldest"]
        yield GaugeMetricFamily("controlplane_chunk_heartbeat_age_max_seconds", "Age of the oldest heartbeat "
                                "among running chunks", value=(now - oldest).total_seconds() if oldest else 0)
        yield GaugeMetricFamily("controlplane_chunks_waiting", "Dispatched chunks of runnable jobs no worker "
                                "has taken yet", value=waiting["n"] or 0)
        oldest = waiting["oldest"]
        yield GaugeMetricFamily("controlplane_chunk_wait_max_seconds", "How long the longest-waiting dispatched "
                                "chunk has waited for a worker (lease lag still in progress)",
                                value=max(0.0, (now - oldest).total_seconds()) if oldest else 0)
        yield GaugeMetricFamily("controlplane_workers", "Celery workers alive (heartbeat fresher than "
                                "ALIVE_AFTER_S)", value=workers["n"] or 0)
        yield GaugeMetricFamily("controlplane_worker_slots", "Task slots (concurrency) over the live workers",
                                value=workers["slots"] or 0)


def registry_for_scrape(path: str | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path or str(settings.PROMETHEUS_MULTIPROC_DIR))
    registry.register(DatabaseCollector())
    return registry
