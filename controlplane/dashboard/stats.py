"""Numbers the job, compare and history pages show, each traceable to stored data:
stored summaries (job.aggregate_metrics, job.timing_summary) when the job has them, otherwise a
live estimate over the job's most recent rollouts (labelled as such on the page)."""
from __future__ import annotations

import math
import statistics

from django.db.models import Avg, Count

from controlplane.jobs.models import Rollout

TIMING_FIELDS = ["queue_ms", "ttft_ms", "generation_ms", "verify_ms", "wall_ms"]
PERCENTILES = [50, 90, 99]
LIVE_SAMPLE = 5000


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of an already sorted list."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return sorted_values[lo]
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def _recent_rows(job, fields, n=LIVE_SAMPLE, ok_only=False):
    qs = Rollout.objects.filter(job=job)
    if ok_only:
        qs = qs.filter(status=Rollout.Status.OK)
    # (job, id) index, newest first: constant cost whatever the job's size.
    return list(qs.order_by("-id").values_list(*fields)[:n])


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


def timing_breakdown(job) -> dict:
    """Per-rollout timing percentiles: the stored summary, else the latest LIVE_SAMPLE rollouts."""
    if job.timing_summary:
        rows = _normalize_timing_summary(job.timing_summary)
        if rows:
            return {"source": "stored", "rows": rows, "sample": None}
    data = _recent_rows(job, TIMING_FIELDS, ok_only=True)
    rows = []
    for i, field in enumerate(TIMING_FIELDS):
        vals = sorted(r[i] for r in data if r[i] is not None)
        row = {"field": field.removesuffix("_ms"), "count": len(vals), "mean": (sum(vals) / len(vals)) if vals else None}
        for p in PERCENTILES:
            row[f"p{p}"] = percentile(vals, p)
        rows.append(row)
    return {"source": "live", "rows": rows, "sample": len(data)}


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
        return {"source": "stored", "items": flat, "sample": None}
    data = _recent_rows(job, ["reward", "output_tokens", "input_tokens"], ok_only=True)
    items = []
    for i, name in enumerate(["reward", "output_tokens", "input_tokens"]):
        vals = [r[i] for r in data if r[i] is not None]
        if not vals:
            continue
        items += [
            (f"mean/{name}", statistics.fmean(vals)),
            (f"min/{name}", min(vals)),
            (f"max/{name}", max(vals)),
            (f"std/{name}", statistics.pstdev(vals) if len(vals) > 1 else 0.0),
        ]
    return {"source": "live", "items": items, "sample": len(data)}


def mean_reward(job) -> float | None:
    am = job.aggregate_metrics or {}
    for key in ("mean/reward", "reward/mean", "mean_reward"):
        if isinstance(am.get(key), (int, float)):
            return float(am[key])
    if isinstance(am.get("reward"), dict) and isinstance(am["reward"].get("mean"), (int, float)):
        return float(am["reward"]["mean"])
    return None


def failures_by_class(job) -> list[tuple[str, int]]:
    """Failed rollouts by failure class (the (job, status, id) index keeps this cheap)."""
    rows = (
        Rollout.objects.filter(job=job, status=Rollout.Status.FAILED)
        .values("failure_class")
        .annotate(n=Count("id"))
        .order_by("-n")
    )
    return [(r["failure_class"] or "unknown", r["n"]) for r in rows]


def per_task_pass_rates(job) -> dict[int, float]:
    """task_index -> mean reward over its repeats (ok rows only)."""
    rows = (
        Rollout.objects.filter(job=job, status=Rollout.Status.OK, reward__isnull=False)
        .values("task_index")
        .annotate(r=Avg("reward"))
        .values_list("task_index", "r")
    )
    return dict(rows)
