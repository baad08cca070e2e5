"""The scrape: the event counters every process records (controlplane.telemetry, multi-process files)
plus state read from the database at scrape time (DatabaseCollector), the same answer whichever web process
is scraped."""
from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db.utils import OperationalError
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from controlplane import telemetry

from .database import PROBE_TIMEOUT_S, database_answers

logger = logging.getLogger(__name__)


# --- state read from the database when scraped ---------------------------------------------------------
class DatabaseCollector:
    """Gauges computed per scrape from a few aggregate queries on small tables (jobs, chunks, heartbeats;
    never a count over the rollouts table). A database error gives controlplane_database_up 0, not a 500;
    `reachable` False (the scrape's bounded probe found no database): 0 at once, without a query that would wait
    for the pool's timeout."""

    def __init__(self, reachable: bool = True):
        self.reachable = reachable

    def collect(self):
        from django.db.models import Count, Min, Q, Sum
        from django.utils import timezone

        from controlplane.jobs.models import CollectionJob, JobChunk, JobState

        up = GaugeMetricFamily("controlplane_database_up", "1 when the database answered this scrape's queries")
        try:
            if not self.reachable:
                raise OperationalError(f"no answer within {PROBE_TIMEOUT_S:g} s")
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


def registry_for_scrape(path: str | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path or str(settings.PROMETHEUS_MULTIPROC_DIR))
    # one bounded look first: with the database down a scrape answers in seconds (database_up 0), not after
    # each collector's query has waited out the connection pool's timeout
    reachable = database_answers()
    registry.register(DatabaseCollector(reachable))
    if reachable:  # the other apps' collectors read the database too
        for collector in telemetry.SCRAPE_COLLECTORS:
            registry.register(collector)
    return registry
