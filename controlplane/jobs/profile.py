"""Per-task reward profile (NeMo Gym's "filter and curate"): for each task of a job, over its rollouts, how many,
the mean reward, its variance, the pass rate and the range. Computed in the database (one GROUP BY), so a job of
millions of rollouts is profiled without reading its rows.

A task whose ok rollouts' rewards are all equal (variance 0) gives a group-relative advantage no signal: the
summary counts them, with the tasks always passed and never passed.
"""
from __future__ import annotations

import csv
import io
from typing import Iterator

from django.db.models import Avg, Count, FloatField, Max, Min, Q
from django.db.models.functions import Cast

from .models import Rollout

FIELDS = ("task_index", "rollouts", "ok", "mean_reward", "reward_variance", "pass_rate", "min_reward", "max_reward")
ORDERS = {"task": ("task_index",), "mean": ("mean_reward", "task_index"), "-mean": ("-mean_reward", "task_index"),
          "variance": ("reward_variance", "task_index"), "-variance": ("-reward_variance", "task_index"),
          "pass_rate": ("pass_rate", "task_index"), "-pass_rate": ("-pass_rate", "task_index")}


def _rows(job, pass_threshold: float):
    reward = Cast("reward", FloatField())
    ok = Q(status=Rollout.Status.OK, reward__isnull=False)
    return (Rollout.objects.filter(job=job).values("task_index")
            .annotate(rollouts=Count("id"), ok=Count("id", filter=ok),
                      mean_reward=Avg(reward, filter=ok), mean_sq=Avg(reward * reward, filter=ok),
                      passed=Count("id", filter=ok & Q(reward__gte=pass_threshold)),
                      min_reward=Min(reward, filter=ok), max_reward=Max(reward, filter=ok)))


def _finish(r: dict) -> dict:
    mean, sq, n = r.pop("mean_reward"), r.pop("mean_sq"), r["ok"]
    # population variance E[r^2] - E[r]^2, never below 0 from rounding; exactly 0 when every reward is equal
    equal = n > 0 and r["min_reward"] == r["max_reward"]
    var = 0.0 if equal else (max(0.0, sq - mean * mean) if n else None)
    passed = r.pop("passed")
    return {"task_index": r["task_index"], "rollouts": r["rollouts"], "ok": n,
            "mean_reward": mean, "reward_variance": var, "pass_rate": (passed / n) if n else None,
            "min_reward": r["min_reward"], "max_reward": r["max_reward"]}


def task_profile(job, *, pass_threshold: float = 1.0, order: str = "task", limit: int | None = None,
                 offset: int = 0) -> dict:
    """{"tasks": [{task_index, rollouts, ok, mean_reward, reward_variance, pass_rate, min_reward, max_reward}...],
    "summary": {tasks, zero_variance, always_pass, never_pass, mean_pass_rate, pass_threshold}}. A pass is an ok
    rollout with reward >= pass_threshold; the figures are over ok rollouts with a reward."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}")
    tasks = [_finish(r) for r in _rows(job, pass_threshold).order_by("task_index")]
    scored = [t for t in tasks if t["ok"]]
    summary = {"tasks": len(tasks), "scored": len(scored), "pass_threshold": pass_threshold,
               "zero_variance": sum(1 for t in scored if t["reward_variance"] == 0 and t["ok"] > 1),
               "always_pass": sum(1 for t in scored if t["pass_rate"] == 1.0),
               "never_pass": sum(1 for t in scored if t["pass_rate"] == 0.0),
               "mean_pass_rate": (sum(t["pass_rate"] for t in scored) / len(scored)) if scored else None}
    keys = ORDERS[order]

    def sort_key(t):
        out = []
        for k in keys:
            name, desc = k.lstrip("-"), k.startswith("-")
            v = t[name]
            out.append((v is None, -v if (desc and v is not None) else v))
        return out

    tasks.sort(key=sort_key)
    end = None if limit is None else offset + limit
    return {"tasks": tasks[offset:end], "summary": summary}


def iter_csv(job, *, pass_threshold: float = 1.0, order: str = "task") -> Iterator[str]:
    """The profile as CSV text, a header line then one line per task."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(FIELDS)
    for t in task_profile(job, pass_threshold=pass_threshold, order=order)["tasks"]:
        w.writerow(["" if t[f] is None else (round(t[f], 6) if isinstance(t[f], float) else t[f]) for f in FIELDS])
    yield buf.getvalue()



PANEL_TASKS = 20


def panel_context(request, job) -> dict:
    """The job page's panel: the summary and the PANEL_TASKS tasks with the most reward variance."""
    return {"profile": task_profile(job, order="-variance", limit=PANEL_TASKS)}
