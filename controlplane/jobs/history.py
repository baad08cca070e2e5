"""History: every job a user ran, one row each with its throughput and reward - the profiling guide's
`throughput_log.csv`, for the History page, its CSV and the API (`GET /api/history/`, with a token).
One builder, so the page, the CSV and the API show the same rows; the figures are controlplane.jobs.figures'."""
from __future__ import annotations

import csv
from collections import defaultdict
from datetime import timedelta

from django.db import connection
from django.db.models import Avg
from django.utils import timezone

from . import figures
from .models import JobMetricSample, Rollout

MAX_ROWS = 2000

CSV_COLUMNS = ["date", "job_id", "name", "state", "dataset", "model", "num_samples_in_parallel", "rollouts",
               "elapsed_sec", "samples_per_sec", "tokens_per_sec", "output_tokens_per_sec", "avg_reward",
               "parallelism_run_mean", "parallelism_run_min", "parallelism_run_max"]


def stored_mean_reward(job) -> float | None:
    """The job's mean reward from its stored aggregate metrics (None when it has none yet)."""
    am = job.aggregate_metrics or {}
    for key in ("mean/reward", "reward/mean", "mean_reward"):
        if isinstance(am.get(key), (int, float)):
            return float(am[key])
    if isinstance(am.get("reward"), dict) and isinstance(am["reward"].get("mean"), (int, float)):
        return float(am["reward"]["mean"])
    return None


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



def history_rows(jobs_qs, days: int | None) -> list[dict]:
    """Rows oldest first for the started jobs of `jobs_qs` (created in the last `days` when given)."""
    qs = jobs_qs.select_related("dataset", "endpoint").exclude(started_at=None)
    if days:
        qs = qs.filter(created_at__gte=timezone.now() - timedelta(days=days))
    jobs = list(qs.order_by("created_at")[:MAX_ROWS])
    missing = [j.pk for j in jobs if stored_mean_reward(j) is None]
    live_means = {}
    if missing:
        live_means = dict(Rollout.objects.filter(job_id__in=missing, status=Rollout.Status.OK)
                          .values("job_id").annotate(m=Avg("reward")).values_list("job_id", "m"))
    ran = parallelism_run(j.pk for j in jobs)
    figs = figures.history_figures(jobs)
    rows = []
    for j in jobs:
        f = figs[j.pk]
        rm = stored_mean_reward(j)
        rows.append({
            "job": j,
            "date": j.started_at,
            "rollouts": j.done_count,
            "elapsed_s": f["running_s"],  # running time, pauses excluded
            "samples_per_s": f["rollouts_per_s"],
            "tokens_per_s": f["tokens_per_s"],
            "output_tokens_per_s": f["output_tokens_per_s"],
            "mean_reward": rm if rm is not None else live_means.get(j.pk),
            # what it actually ran at (min / mean / max): an adaptive job moves; a fixed one ran at its setting (its
            # chunks' shares only look smaller for the second one chunk ends and the other has not yet taken its share)
            "parallelism": ran.get(j.pk) if j.parallelism_auto else (
                {"min": j.effective_parallelism, "mean": float(j.effective_parallelism), "max": j.effective_parallelism}
                if j.pk in ran else None),
        })
    return rows


def _f(x, digits):
    return f"{x:.{digits}f}" if x is not None else ""


def csv_cell(text: str) -> str:
    """A user-written cell a spreadsheet must not run as a formula: a leading = + - @ (or tab, CR) gets a
    leading apostrophe (the OWASP practice)."""
    text = str(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def write_csv(rows: list[dict], out) -> None:
    """The rows as throughput_log.csv into `out` (a file-like)."""
    cell = csv_cell
    w = csv.writer(out)
    w.writerow(CSV_COLUMNS)
    for r in rows:
        j = r["job"]
        w.writerow([r["date"].isoformat(), j.pk, cell(j.name), j.state, cell(j.dataset.name), cell(j.endpoint.model_name),
                    j.num_samples_in_parallel, r["rollouts"], _f(r["elapsed_s"], 3), _f(r["samples_per_s"], 4),
                    _f(r["tokens_per_s"], 2), _f(r["output_tokens_per_s"], 2), _f(r["mean_reward"], 4),
                    *((r["parallelism"]["mean"], r["parallelism"]["min"], r["parallelism"]["max"])
                      if r["parallelism"] else ("", "", ""))])


def as_json(r: dict) -> dict:
    """A row for the API."""
    j = r["job"]
    return {"date": r["date"].isoformat(), "job_id": j.pk, "name": j.name, "state": j.state,
            "dataset": j.dataset.name, "model": j.endpoint.model_name,
            "num_samples_in_parallel": j.num_samples_in_parallel, "rollouts": r["rollouts"],
            "elapsed_s": r["elapsed_s"], "rollouts_per_s": r["samples_per_s"], "tokens_per_s": r["tokens_per_s"],
            "output_tokens_per_s": r["output_tokens_per_s"], "mean_reward": r["mean_reward"],
            "parallelism_run": r["parallelism"]}
