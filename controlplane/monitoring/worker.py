"""A worker host's own /metrics, for workers on a machine other than the web server's.

Counters live in files on the host that recorded them, so a second machine's workers are scraped on that
machine: with WORKER_METRICS_PORT set, a Celery worker serves its host's PROMETHEUS_MULTIPROC_DIR (every
process writing there, summed) on WORKER_METRICS_ADDR:WORKER_METRICS_PORT when it starts. Several workers on
one host: the first to bind serves them all, the others log that and go on. The database-derived gauges
come from the web's /metrics only (one answer, whichever host is asked)."""
from __future__ import annotations

import logging

from django.conf import settings

logger = logging.getLogger(__name__)


def start_worker_exporter(sender=None, **kwargs):
    port = getattr(settings, "WORKER_METRICS_PORT", 0)
    if not port:
        return
    from controlplane import telemetry  # noqa: F401 - sets up the multi-process directory
    from .exporter import serve

    try:
        serve(str(settings.PROMETHEUS_MULTIPROC_DIR), port, settings.WORKER_METRICS_ADDR)
        logger.info("worker metrics on http://%s:%s/metrics", settings.WORKER_METRICS_ADDR, port)
    except OSError as exc:
        logger.info("worker metrics port %s not bound (%s): another worker on this host serves it", port, exc)


def connect_signals():
    from controlplane import worker_signals

    worker_signals.on("worker_ready", start_worker_exporter, "monitoring-worker-exporter")
