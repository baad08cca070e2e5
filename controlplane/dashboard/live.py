"""Job state for the dashboard, read from the database: the same shape as the `job.progress` events
of controlplane/jobs/events.py, so a page reload (or a reconnecting socket) shows what the live
stream showed. Also the metric series behind the charts."""
from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from controlplane.jobs.models import JobMetricSample, JobState

# A worker's latest sample counts toward the job's current rate while it is this fresh.
RATE_WINDOW_S = 10
SERIES_MAX_POINTS = 1800  # seconds of history the charts start with


def current_rates(job) -> dict:
    """Sum of each worker's latest sample within RATE_WINDOW_S (only while the job runs)."""
    out = {"samples_per_s": 0.0, "output_tokens_per_s": 0.0, "in_flight": 0, "parallelism": 0, "errors": {}}
    if job.state != JobState.RUNNING:
        return out
    cutoff = timezone.now() - timedelta(seconds=RATE_WINDOW_S)
    latest: dict[str, JobMetricSample] = {}
    for s in JobMetricSample.objects.filter(job=job, t__gte=cutoff).order_by("-t")[:200]:
        latest.setdefault(s.worker, s)
    for s in latest.values():
        out["samples_per_s"] += s.samples_per_s
        out["output_tokens_per_s"] += s.output_tokens_per_s
        out["in_flight"] += s.in_flight
        out["parallelism"] += s.parallelism
        for k, v in (s.errors or {}).items():
            out["errors"][k] = out["errors"].get(k, 0) + v
    return out


def elapsed_s(job) -> float | None:
    if not job.started_at:
        return None
    end = job.finished_at or timezone.now()
    return max((end - job.started_at).total_seconds(), 0.0)


def average_rate(job) -> float | None:
    el = elapsed_s(job)
    if not el:
        return None
    return job.done_count / el


def job_snapshot(job) -> dict:
    """The `job.progress` payload rebuilt from the database (plus a few display-only fields)."""
    rates = current_rates(job)
    remaining = max(job.total_rollouts - job.done_count, 0)
    eta = None
    if job.state == JobState.RUNNING and rates["samples_per_s"] > 0:
        eta = remaining / rates["samples_per_s"]
    elif remaining == 0 and job.total_rollouts:
        eta = 0.0
    return {
        "type": "job.progress",
        "job_id": job.pk,
        "state": job.state,
        "total": job.total_rollouts,
        "completed": job.completed_count,
        "failed": job.failed_count,
        "done": job.done_count,
        "in_flight": rates["in_flight"],
        "parallelism": rates["parallelism"] or job.num_samples_in_parallel,
        "samples_per_s": round(rates["samples_per_s"], 3),
        "output_tokens_per_s": round(rates["output_tokens_per_s"], 3),
        "eta_s": eta,
        "errors": rates["errors"],
        "t": time.time(),
        "stalled": job.stalled,
        "avg_samples_per_s": average_rate(job),
        "elapsed_s": elapsed_s(job),
        "error_message": job.error_message,
    }


def metric_series(job, max_points: int = SERIES_MAX_POINTS) -> dict:
    """The job's metric time series for the charts: the last `max_points` seconds before its latest
    sample, samples from all workers summed per second (so the cost is bounded whatever the job's
    length). Columns (uPlot's layout): t (unix s), samples_per_s, output_tokens_per_s, in_flight, and
    one column per error class. Aggregated in the database on PostgreSQL."""
    last = JobMetricSample.objects.filter(job=job).order_by("-t").values_list("t", flat=True).first()
    if last is None:
        return {"t": [], "samples_per_s": [], "output_tokens_per_s": [], "in_flight": [], "error_classes": [], "errors": {}}
    window = JobMetricSample.objects.filter(job=job, t__gt=last - timedelta(seconds=max_points))
    if connection.vendor == "postgresql":
        buckets, err = _series_postgres(job.pk, last - timedelta(seconds=max_points))
    else:
        buckets, err = _series_python(window)
    secs = sorted(buckets)[-max_points:]
    classes_sorted = sorted({c for per in err.values() for c in per})
    return {
        "t": secs,
        "samples_per_s": [round(buckets[s][0], 3) for s in secs],
        "output_tokens_per_s": [round(buckets[s][1], 3) for s in secs],
        "in_flight": [int(buckets[s][2]) for s in secs],
        "error_classes": classes_sorted,
        "errors": {c: [err.get(s, {}).get(c, 0) for s in secs] for c in classes_sorted},
    }


def _series_python(window):
    buckets: dict[int, list] = {}
    err: dict[int, dict] = defaultdict(dict)
    for t, sps, tps, inflight, errors in window.values_list("t", "samples_per_s", "output_tokens_per_s", "in_flight", "errors"):
        sec = int(t.timestamp())
        b = buckets.setdefault(sec, [0.0, 0.0, 0])
        b[0] += sps
        b[1] += tps
        b[2] += inflight
        for k, v in (errors or {}).items():
            err[sec][k] = err[sec].get(k, 0) + v
    return buckets, err


def _series_postgres(job_id, since):
    table = JobMetricSample._meta.db_table
    buckets: dict[int, list] = {}
    err: dict[int, dict] = defaultdict(dict)
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT floor(extract(epoch FROM t))::bigint AS sec, sum(samples_per_s), sum(output_tokens_per_s), "
            f"sum(in_flight) FROM {table} WHERE job_id = %s AND t > %s GROUP BY sec",
            [job_id, since],
        )
        for sec, sps, tps, inflight in cur.fetchall():
            buckets[sec] = [sps or 0.0, tps or 0.0, inflight or 0]
        cur.execute(
            f"SELECT floor(extract(epoch FROM t))::bigint AS sec, e.key, sum((e.value)::numeric) "
            f"FROM {table}, jsonb_each_text(errors) AS e WHERE job_id = %s AND t > %s AND errors <> '{{}}'::jsonb "
            f"GROUP BY sec, e.key",
            [job_id, since],
        )
        for sec, key, n in cur.fetchall():
            err[sec][key] = int(n)
    return buckets, err
