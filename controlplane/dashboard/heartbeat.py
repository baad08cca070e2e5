"""Worker heartbeat: every Celery worker writes its host, CPU and GPU into WorkerHeartbeat.

Connected in DashboardConfig.ready(): `worker_ready` starts a daemon thread that upserts the row
every HEARTBEAT_INTERVAL_S seconds; `worker_shutdown` marks it stopped. The overview counts a worker
alive while its row is fresher than ALIVE_AFTER_S.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta

from django.utils import timezone

from workers.telemetry.host import GpuSampler

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = float(os.environ.get("WORKER_HEARTBEAT_INTERVAL_S", "5"))
ALIVE_AFTER_S = max(3 * HEARTBEAT_INTERVAL_S, 15.0)

_stop = threading.Event()
_state: dict = {}


def gpu_snapshot() -> list[dict]:
    """GPUs through NVML (the telemetry's GpuSampler) where present; an empty list on hosts without one."""
    sampler = GpuSampler()
    try:
        return [{"index": g["index"], "name": g.get("name", ""), "util_percent": round(g.get("util", 0)),
                 "mem_used_mb": round(g.get("mem_used_mb", 0)), "mem_total_mb": round(g.get("mem_total_mb", 0))}
                for g in sampler.sample() or []]
    finally:
        sampler.close()


def host_snapshot() -> dict:
    import psutil

    proc = _state.setdefault("proc", psutil.Process())
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_percent": psutil.cpu_percent(interval=None),
        "cpu_count": psutil.cpu_count() or 0,
        "process_cpu_percent": proc.cpu_percent(interval=None),
        "memory_percent": psutil.virtual_memory().percent,
        "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
        "gpus": gpu_snapshot(),
    }


def beat(name: str, concurrency: int = 0, stopped: bool = False) -> None:
    from .models import WorkerHeartbeat

    now = timezone.now()
    snap = host_snapshot()
    WorkerHeartbeat.objects.update_or_create(
        name=name,
        defaults={**snap, "last_seen": now, "stopped": stopped, "concurrency": concurrency},
        create_defaults={**snap, "last_seen": now, "stopped": stopped, "concurrency": concurrency, "started_at": now},
    )


def _loop(name: str, concurrency: int) -> None:
    from django.db import close_old_connections

    while not _stop.is_set():
        close_old_connections()  # this thread's connection: drop it if the server closed it
        try:
            beat(name, concurrency)
        except Exception as e:  # noqa: BLE001 - the heartbeat must never take the worker down
            log.warning("worker heartbeat failed: %s", e)
        _stop.wait(HEARTBEAT_INTERVAL_S)


def on_worker_ready(sender=None, **kwargs):
    name = getattr(sender, "hostname", None) or f"celery@{socket.gethostname()}:{os.getpid()}"
    concurrency = getattr(getattr(sender, "controller", None), "concurrency", 0) or 0
    _state["name"] = name
    _stop.clear()
    threading.Thread(target=_loop, args=(name, int(concurrency)), name="dashboard-heartbeat", daemon=True).start()


def on_worker_shutdown(sender=None, **kwargs):
    _stop.set()
    name = _state.get("name")
    if name:
        try:
            beat(name, stopped=True)
        except Exception as e:  # noqa: BLE001
            log.warning("final worker heartbeat failed: %s", e)


def alive_workers():
    from .models import WorkerHeartbeat

    cutoff = timezone.now() - timedelta(seconds=ALIVE_AFTER_S)
    return WorkerHeartbeat.objects.filter(last_seen__gte=cutoff, stopped=False)


def connect_signals():
    from controlplane import worker_signals

    worker_signals.on("worker_ready", on_worker_ready, "dashboard-heartbeat-ready")
    worker_signals.on("worker_shutdown", on_worker_shutdown, "dashboard-heartbeat-shutdown")


class WorkersCollector:
    """Prometheus gauges of the live workers, from their heartbeats (registered for the scrape in ready())."""

    def collect(self):
        from django.db.models import Count, Sum
        from prometheus_client.core import GaugeMetricFamily

        try:
            workers = alive_workers().aggregate(n=Count("id"), slots=Sum("concurrency"))
        except Exception as exc:  # noqa: BLE001 - the database gauge already reports the outage
            log.warning("metrics: worker heartbeats unavailable: %s", exc)
            return
        yield GaugeMetricFamily("controlplane_workers", "Celery workers alive (heartbeat fresher than "
                                "ALIVE_AFTER_S)", value=workers["n"] or 0)
        yield GaugeMetricFamily("controlplane_worker_slots", "Task slots (concurrency) over the live workers",
                                value=workers["slots"] or 0)
