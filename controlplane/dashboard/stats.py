"""Numbers the job, compare and history pages show, each traceable to stored data:
stored summaries (job.aggregate_metrics, job.timing_summary) when the job has them, otherwise a
live estimate over the job's most recent rollouts (labelled as such on the page)."""
from __future__ import annotations

import statistics

from django.core.cache import cache
from django.db import connection
from django.db.models import Avg, Count

from controlplane.jobs.history import stored_mean_reward
from controlplane.jobs.models import JobMetricSample, Rollout
from workers.diagnosis.evidence import build_evidence
from workers.engine.aggregate import quantile
from workers.engine.types import TIMING_FIELDS

PERCENTILES = [50, 90, 99]
LIVE_SAMPLE = 5000


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (0-100) of an already sorted list; None when it is empty."""
    return quantile(sorted_values, p / 100.0) if sorted_values else None


def _recent_rows(job, fields, n=LIVE_SAMPLE, ok_only=False):
    qs = Rollout.objects.filter(job=job)
    if ok_only:
        qs = qs.filter(status=Rollout.Status.OK)
    # (job, id) index, newest first: constant cost whatever the job's size.
    return list(qs.order_by("-id").values_list(*fields)[:n])


SAMPLE_FIELDS = [*TIMING_FIELDS, "reward", "output_tokens", "input_tokens"]


def live_sample_stats(job, n=LIVE_SAMPLE) -> dict:
    """{field: {"values": sorted list} or {"p50",...}} over the latest n successful rollouts: on
    PostgreSQL one query computes percentiles, mean, min, max, std and count in the database; elsewhere
    the rows are fetched and computed here. Memoized on the job instance for the request."""
    cached = getattr(job, "_dashboard_live_stats", None)
    if cached is not None:
        return cached
    out: dict = {"sample": 0, "fields": {}}
    if connection.vendor == "postgresql":
        table = Rollout._meta.db_table
        parts = []
        for f in SAMPLE_FIELDS:
            parts.append(f"percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY {f}), avg({f}), min({f}), "
                         f"max({f}), stddev_pop({f}), count({f})")
        sql = (f"WITH r AS (SELECT {', '.join(SAMPLE_FIELDS)} FROM {table} WHERE job_id = %s AND status = %s "
               f"ORDER BY id DESC LIMIT %s) SELECT count(*), {', '.join(parts)} FROM r")
        with connection.cursor() as cur:
            cur.execute(sql, [job.pk, Rollout.Status.OK, n])
            row = cur.fetchone()
        out["sample"] = row[0]
        for i, f in enumerate(SAMPLE_FIELDS):
            pcts, mean, lo, hi, std, count = row[1 + 6 * i: 7 + 6 * i]
            pcts = pcts or [None, None, None]
            out["fields"][f] = {"p50": pcts[0], "p90": pcts[1], "p99": pcts[2], "mean": mean, "min": lo, "max": hi,
                                "std": std, "count": count}
    else:
        data = _recent_rows(job, SAMPLE_FIELDS, n=n, ok_only=True)
        out["sample"] = len(data)
        for i, f in enumerate(SAMPLE_FIELDS):
            vals = sorted(r[i] for r in data if r[i] is not None)
            out["fields"][f] = {
                "p50": percentile(vals, 50), "p90": percentile(vals, 90), "p99": percentile(vals, 99),
                "mean": statistics.fmean(vals) if vals else None, "min": vals[0] if vals else None,
                "max": vals[-1] if vals else None, "std": statistics.pstdev(vals) if len(vals) > 1 else (0.0 if vals else None),
                "count": len(vals),
            }
    job._dashboard_live_stats = out
    return out


def _normalize_timing_summary(summary: dict) -> list[dict]:
    """Accept the stored timing_summary as {field: {p50: .., p90: .., p99: .., mean: ..}} (also
    'queue'/'queue_ms' keys, or percentiles as 'p50_ms'); anything else is shown raw."""
    rows = []
    for field, vals in summary.items():
        if not isinstance(vals, dict):
            continue
        row = {"field": field.removesuffix("_ms")}
        for p in PERCENTILES:
            row[f"p{p}"] = vals.get(f"p{p}", vals.get(f"p{p}_ms"))
        row["mean"] = vals.get("mean", vals.get("mean_ms"))
        row["count"] = vals.get("count", vals.get("n"))
        rows.append(row)
    return rows


# stage -> (label, what it measures): the table's row names and their tooltips
TIMING_LABELS = {
    "queue": ("slot wait", "From the task being read ahead (prefetched, up to 2 x parallelism) until a parallelism "
                           "slot took it, plus client-side rate-limit pacing. Not time on the model server: it is "
                           "large when num_samples_in_parallel is the limit, since tasks are read ahead of free slots."),
    "ttft": ("TTFT", "Request sent -> first generated token (streaming), or the whole request (not streaming)."),
    "generation": ("generation", "First -> last generated token (streaming only)."),
    "verify": ("verify", "Time in the verifier, including the hop to its process pool."),
    "wall": ("wall", "Slot taken -> verified: the rollout's own time, with retries and backoff (slot wait excluded)."),
}


def _labelled(rows: list[dict]) -> list[dict]:
    for row in rows:
        row["label"], row["help"] = TIMING_LABELS.get(row["field"], (row["field"], ""))
    return rows


def timing_breakdown(job) -> dict:
    """Per-rollout timing percentiles: the stored summary, else the latest LIVE_SAMPLE rollouts."""
    if job.timing_summary:
        rows = _normalize_timing_summary(job.timing_summary)
        if rows:
            return {"source": "stored", "rows": _labelled(rows), "sample": None}
    live = live_sample_stats(job)
    rows = []
    for field in TIMING_FIELDS:
        st = live["fields"][field]
        rows.append({"field": field.removesuffix("_ms"), "count": st["count"], "mean": st["mean"],
                     "p50": st["p50"], "p90": st["p90"], "p99": st["p99"]})
    return {"source": "live", "rows": _labelled(rows), "sample": live["sample"]}


AGENT_SPLIT_TICKS = 2000


def agent_split(job) -> dict | None:
    """NeMo Gym agent jobs: where each /run's time goes, per rollout (means, ms) - the model server's part (its
    /metrics) and the agent's own (its work, tools, its /verify call) - from the job's progress ticks. None for
    other jobs, or before a tick carried the figures."""
    if not getattr(job.endpoint, "is_nemo_gym", False):
        return None
    ticks = list(JobMetricSample.objects.filter(job_id=job.pk).order_by("-t")
                 .values("worker", "t", "elapsed_s", "completed", "failed", "in_flight", "parallelism", "extra")
                 [:AGENT_SPLIT_TICKS])
    ticks.reverse()
    ev = build_evidence(ticks)
    if not ev.agent_job or ev.agent_run_ms is None:
        return None
    return {"run_ms": ev.agent_run_ms, "model_ms": ev.agent_model_ms, "model_calls": ev.agent_model_calls,
            "agent_ms": ev.agent_own_ms, "agent_share": ev.agent_share, "model_share": ev.model_share}


STAT_COLUMNS = ("mean", "median", "min", "max", "std")


def metric_tables(items: list[tuple[str, float]]) -> dict:
    """NeMo Gym's flat metric keys as tables: one row per field with columns mean / median / min / max / std
    ("mean/reward" or "reward/mean"), pass@k and majority@k by k, and the rest (num_rows, ...) as counts."""
    fields: dict[str, dict] = {}
    passk, counts = [], []
    for key, value in items:
        head, _, tail = key.partition("/")
        if tail and head in STAT_COLUMNS:
            fields.setdefault(tail, {"field": tail, "keys": {}})[head] = value
            fields[tail]["keys"][head] = key
        elif tail and tail in STAT_COLUMNS:
            fields.setdefault(head, {"field": head, "keys": {}})[tail] = value
            fields[head]["keys"][tail] = key
        elif key.startswith(("pass@", "majority@")):
            kind, _, k = key.partition("@")
            passk.append({"metric": key, "kind": kind, "k": int(k) if k.isdigit() else k, "value": value})
        else:
            counts.append((key, value))
    rows = sorted(fields.values(), key=lambda r: (r["field"] != "reward", r["field"]))
    for row in rows:
        row["cells"] = [(row.get(c), row["keys"].get(c, "")) for c in STAT_COLUMNS]
    passk.sort(key=lambda p: (p["kind"] != "pass", str(p["k"]).zfill(8)))
    return {"rows": rows, "passk": passk, "counts": counts}


def reward_metrics(job) -> dict:
    """Aggregate metrics: the stored ones (mean/reward, pass@k ...), else live over recent rows."""
    if job.aggregate_metrics:
        flat = []
        for k, v in sorted(job.aggregate_metrics.items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                flat.append((k, v))
            elif isinstance(v, dict):
                for k2, v2 in sorted(v.items()):
                    if isinstance(v2, (int, float)) and not isinstance(v2, bool):
                        flat.append((f"{k}/{k2}", v2))
        return {"source": "stored", "items": flat, "sample": None, **metric_tables(flat)}
    live = live_sample_stats(job)
    items = []
    for name in ["reward", "output_tokens", "input_tokens"]:
        st = live["fields"][name]
        if not st["count"]:
            continue
        items += [(f"mean/{name}", st["mean"]), (f"median/{name}", st["p50"]), (f"min/{name}", st["min"]),
                  (f"max/{name}", st["max"]), (f"std/{name}", st["std"])]
    return {"source": "live", "items": items, "sample": live["sample"], **metric_tables(items)}


mean_reward = stored_mean_reward  # one reading of a job's stored mean reward (controlplane.jobs.history)


FAILURES_CACHE_S = 10


def failures_by_class(job) -> list[tuple[str, int]]:
    """Failed rollouts by failure class, from the rollouts table. COUNT(*) so that an index on
    (job, status, failure_class) answers it index-only; cached for a few seconds per (job, failed
    count), since a busy job page is reloaded by many users at once."""
    key = f"dashboard:failures:{job.pk}:{job.failed_count}:{job.state}"
    hit = cache.get(key)
    if hit is not None:
        return hit
    rows = (
        Rollout.objects.filter(job=job, status=Rollout.Status.FAILED)
        .order_by()
        .values("failure_class")
        .annotate(n=Count("*"))
    )
    out = sorted(((r["failure_class"] or "unknown", r["n"]) for r in rows), key=lambda x: -x[1])
    cache.set(key, out, FAILURES_CACHE_S)
    return out


def per_task_pass_rates(job) -> dict[int, float]:
    """task_index -> mean reward over its repeats (ok rows only)."""
    rows = (
        Rollout.objects.filter(job=job, status=Rollout.Status.OK, reward__isnull=False)
        .values("task_index")
        .annotate(r=Avg("reward"))
        .values_list("task_index", "r")
    )
    return dict(rows)
