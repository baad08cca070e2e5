"""Job state for the dashboard, read from the database: the same shape as the `job.progress` events
of controlplane/jobs/events.py, so a page reload (or a reconnecting socket) shows what the live
stream showed. Also the metric series behind the charts."""
from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from controlplane.disclosure import error_for
from controlplane.jobs import figures
from controlplane.jobs import history as job_history
from controlplane.jobs.events import job_progress
from controlplane.jobs.models import JobMetricSample

SERIES_MAX_POINTS = 1800  # seconds of history the charts start with
INCOMPLETE_S = 1.0  # a running job's seconds newer than this (plus the second itself) are left to the live stream


def elapsed_s(job) -> float | None:
    """The job's running time, pauses excluded (controlplane.jobs.figures)."""
    return figures.running_seconds(job)


def average_rate(job) -> float | None:
    """Rollouts stored per second of running time (controlplane.jobs.figures)."""
    return figures.average_rate(job)


def job_snapshot(job, now=None, user=None) -> dict:
    """The `job.progress` message rebuilt from the database by the same builder the live stream uses
    (controlplane.jobs.events.job_progress), the error as `user` may read it."""
    out = job_progress(job, now)
    out["error_message"] = error_for(user, job.error_message)
    return out


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
    if str(job.state) == "running":
        # the newest seconds' rows are not all stored yet (batched writes): their rate would dip at the end;
        # the live messages continue the line from there
        fresh = timezone.now().timestamp() - INCOMPLETE_S
        secs = [s for s in secs if s + 1 <= fresh] or secs[:1]
    classes_sorted = sorted({c for per in err.values() for c in per})
    # rates: the live row's figure at each second (stored rows over the recent window, figures.rate_series),
    # so a run's first or last interval is no spike; in flight and errors as the runs reported them
    rates, tokens = figures.rate_series(job.pk, secs, {s for s in secs if buckets[s][2] > 0})
    out = {"t": [], "samples_per_s": [], "output_tokens_per_s": [], "in_flight": [], "error_classes": classes_sorted,
           "errors": {c: [] for c in classes_sorted}}
    prev = None
    for i, s in enumerate(secs):
        if prev is not None and s - prev > figures.GAP_S:  # nothing ran (paused, queued): the lines break
            _append_point(out, prev + 1, None, None, None, {c: None for c in classes_sorted})
        _append_point(out, s, rates[i], tokens[i], int(buckets[s][2]),
                      {c: err.get(s, {}).get(c, 0) for c in classes_sorted})
        prev = s
    if secs and str(job.state) != "running":  # not running now: the line ends at its last sample
        _append_point(out, secs[-1] + 1, None, None, None, {c: None for c in classes_sorted})
    return out


def _append_point(out, t, rate, tokens, in_flight, errors):
    out["t"].append(t)
    out["samples_per_s"].append(rate)
    out["output_tokens_per_s"].append(tokens)
    out["in_flight"].append(in_flight)
    for c, v in errors.items():
        out["errors"][c].append(v)


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


parallelism_run = job_history.parallelism_run  # moved to controlplane.jobs.history (the API's History too)
