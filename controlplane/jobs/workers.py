"""The workers of a job: which worker processes (host and pid) hold or held its chunks, how fast each
collects and when each last heartbeated. Read from the chunk leases and the metric samples the workers
already write (no table of its own), for the job page's workers panel and GET /api/jobs/<id>/workers/.

A worker's name is `<hostname>:<pid>:<kind>:<thread>` (runtime.default_worker_name); a chunk's lease
owner is that name plus `#<token>`; a metric series is `<worker name> chunk <index>`.
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from . import figures
from .events import LIVE_FRESH_S
from .models import JobChunk, JobMetricSample


def _process_key(worker_name: str) -> tuple[str, str]:
    """(hostname, pid) of a worker name; ("", name) for a name of another shape."""
    parts = worker_name.split(":")
    if len(parts) >= 2 and parts[1].isdigit():
        return parts[0], parts[1]
    return "", worker_name


def _latest_samples(job_id):
    """The latest sample of each series (one per chunk run) of the job."""
    qs = JobMetricSample.objects.filter(job_id=job_id)
    fields = ("worker", "t", "completed", "failed", "samples_per_s", "in_flight")
    if connection.vendor == "postgresql":
        return list(qs.order_by("worker", "-t").distinct("worker").values(*fields))
    latest = {}
    for row in qs.order_by("t").values(*fields):
        latest[row["worker"]] = row
    return list(latest.values())


def job_workers(job, now=None) -> list[dict]:
    """One dict per worker process that ran part of the job, live ones first:
    host, pid, worker (its name without the thread), chunks_held (running leases now), chunks_done,
    rollouts (ok + failed rows it stored), rollouts_per_s (rows it stored per second over the job's recent window,
    figures.recent_rate_by_worker; 0 when idle),
    in_flight, last_heartbeat (ISO time or None), alive (heartbeat younger than the lease timeout)."""
    now = now or timezone.now()
    workers: dict[tuple[str, str], dict] = {}

    def entry(name):
        host, pid = _process_key(name)
        return workers.setdefault((host, pid), {
            "host": host, "pid": int(pid) if pid.isdigit() else None,
            "worker": f"{host}:{pid}" if host else pid, "chunks_held": 0, "chunks_done": 0, "rollouts": 0,
            "rollouts_per_s": 0.0, "in_flight": 0, "last_heartbeat": None, "alive": False})

    for state, owner, heartbeat in JobChunk.objects.filter(job_id=job.pk).exclude(lease_owner="").values_list(
            "state", "lease_owner", "heartbeat_at"):
        w = entry(owner.split("#", 1)[0])
        if state == JobChunk.State.RUNNING:
            w["chunks_held"] += 1
        elif state == JobChunk.State.DONE:
            w["chunks_done"] += 1
        if heartbeat and (w["last_heartbeat"] is None or heartbeat > w["last_heartbeat"]):
            w["last_heartbeat"] = heartbeat

    fresh = now - timedelta(seconds=LIVE_FRESH_S)
    for row in _latest_samples(job.pk):
        w = entry(row["worker"].rsplit(" chunk ", 1)[0])
        if row["t"] >= fresh:  # a series that stopped (chunk done, paused, worker gone) holds no slots
            w["in_flight"] += row["in_flight"]
        if w["last_heartbeat"] is None or row["t"] > w["last_heartbeat"]:
            w["last_heartbeat"] = row["t"]
    # rollouts and rates: the rows each worker stored (a killed worker's unstored results count nowhere)
    for name, n in figures.stored_counts_by_worker(job.pk).items():
        entry(name)["rollouts"] += n
    if str(job.state) == "running":
        for name, rate in figures.recent_rate_by_worker(job.pk, now).items():
            entry(name)["rollouts_per_s"] += rate

    alive_after = now - timedelta(seconds=settings.JOBS_LEASE_TIMEOUT_S)
    out = []
    for w in workers.values():
        w["alive"] = bool(w["chunks_held"] and w["last_heartbeat"] and w["last_heartbeat"] >= alive_after)
        if not w["alive"]:  # holds no slot now; what it stored in the window still counts in its rate
            w["in_flight"] = 0
        w["rollouts_per_s"] = round(w["rollouts_per_s"], 1)
        w["last_heartbeat"] = w["last_heartbeat"].isoformat() if w["last_heartbeat"] else None
        out.append(w)
    out.sort(key=lambda w: (not w["alive"], w["host"], w["pid"] or 0))
    return out
