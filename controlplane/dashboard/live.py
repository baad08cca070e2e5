"""Job state for the dashboard, read from the database: the same shape as the `job.progress` events
of controlplane/jobs/events.py, so a page reload (or a reconnecting socket) shows what the live
stream showed. Also the metric series behind the charts."""
from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from controlplane.jobs.events import job_progress
from controlplane.jobs.models import JobMetricSample

SERIES_MAX_POINTS = 1800  # seconds of history the charts start with


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


def job_snapshot(job, now=None) -> dict:
    """The `job.progress` message rebuilt from the database by the same builder the live stream uses
    (controlplane.jobs.events.job_progress), plus a few display-only fields."""
    out = job_progress(job, now)
    out.update({
        "avg_samples_per_s": average_rate(job),
        "elapsed_s": elapsed_s(job),
        "error_message": job.error_message,
    })
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


def parallelism_run(job_ids) -> dict[int, dict]:
    """The parallelism each job actually ran at (an adaptive job moves far from its configured value):
    per second, the sum over its chunk series of their parallelism while they had requests in flight;
    then min / mean / max over those seconds. {job_id: {"min", "mean", "max"}}, jobs without samples left out."""
    job_ids = list(job_ids)
    if not job_ids:
        return {}
    per_sec: dict[tuple[int, int], dict[str, int]] = {}
    if connection.vendor == "postgresql":
        table = JobMetricSample._meta.db_table
        with connection.cursor() as cur:
            cur.execute(
                f"SELECT job_id, min(p)::float, avg(p)::float, max(p)::float FROM ("
                f"  SELECT job_id, sec, sum(p) AS p FROM ("
                f"    SELECT job_id, floor(extract(epoch FROM t))::bigint AS sec, worker, max(parallelism) AS p"
                f"    FROM {table} WHERE job_id = ANY(%s) AND in_flight > 0 GROUP BY job_id, sec, worker"
                f"  ) s GROUP BY job_id, sec"
                f") j GROUP BY job_id",
                [job_ids],
            )
            return {jid: {"min": int(lo), "mean": round(mean, 1), "max": int(hi)} for jid, lo, mean, hi in cur.fetchall()}
    for jid, t, worker, p in (JobMetricSample.objects.filter(job_id__in=job_ids, in_flight__gt=0)
                              .values_list("job_id", "t", "worker", "parallelism")):
        series = per_sec.setdefault((jid, int(t.timestamp())), {})
        series[worker] = max(series.get(worker, 0), p)
    by_job: dict[int, list[int]] = defaultdict(list)
    for (jid, _), series in per_sec.items():
        by_job[jid].append(sum(series.values()))
    return {jid: {"min": min(v), "mean": round(sum(v) / len(v), 1), "max": max(v)} for jid, v in by_job.items()}
