"""Weight versions of rollouts: per-job counts and staleness, and tagging rollouts from servers that
report no version.

A rollout's version is what the server reported (header X-Weight-Version, or the body's
`weight_version`). vLLM reports none: for an endpoint with a weight-update history, such a rollout gets
the version of the update in force when it was dispatched (dispatch = when the sink received it minus
its wall time), counting an update from the moment its pause was sent.

Version lag (staleness) of a rollout = the endpoint's current version - the rollout's version, for
numeric versions (the control plane numbers the versions it assigns 1, 2, 3...); '' = unknown.
"""
from __future__ import annotations

import bisect
from datetime import timedelta
import time

from django.db.models import Count, Q

from .models import WeightVersion


def _num(v: str):
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def job_versions(job) -> dict:
    """{"current": str, "versions": [{"version", "ok", "failed", "total", "lag"}...] (newest first),
    "tagged": n, "untagged": n, "mean_lag": float|None, "max_lag": int|None, "stale": n (lag > 0)}."""
    from controlplane.jobs.models import Rollout

    rows = (Rollout.objects.filter(job=job).values("weight_version")
            .annotate(ok=Count("id", filter=Q(status=Rollout.Status.OK)),
                      failed=Count("id", filter=~Q(status=Rollout.Status.OK))))
    by_version = {r["weight_version"] or "": (r["ok"], r["failed"]) for r in rows}
    tagged = {v: c for v, c in by_version.items() if v}
    current = WeightVersion.objects.filter(endpoint_id=job.endpoint_id).values_list("version", flat=True).first() or ""
    nums = [n for n in (_num(v) for v in [*tagged, current]) if n is not None]
    cur_n = max(nums) if nums else None
    if cur_n is not None:
        current = str(cur_n)
    versions = []
    lag_sum = lag_n = stale = 0
    max_lag = None
    for v, (ok, failed) in tagged.items():
        n = _num(v)
        lag = cur_n - n if (n is not None and cur_n is not None) else None
        versions.append({"version": v, "ok": ok, "failed": failed, "total": ok + failed, "lag": lag})
        if lag is not None:
            lag_sum += lag * (ok + failed)
            lag_n += ok + failed
            stale += (ok + failed) if lag > 0 else 0
            max_lag = lag if max_lag is None else max(max_lag, lag)
    versions.sort(key=lambda d: (_num(d["version"]) is None, -(_num(d["version"]) or 0), d["version"]))
    untagged = sum(by_version.get("", (0, 0)))
    return {"current": current, "versions": versions, "tagged": sum(d["total"] for d in versions),
            "untagged": untagged, "mean_lag": round(lag_sum / lag_n, 3) if lag_n else None, "max_lag": max_lag,
            "stale": stale}


def _history(endpoint_id) -> list[tuple]:
    """[(started_at, version, previous_version)] oldest first."""
    return list(WeightVersion.objects.filter(endpoint_id=endpoint_id).order_by("started_at", "id")
                .values_list("started_at", "version", "previous_version"))


def tag_stored(rollouts, history: list[tuple]) -> int:
    """Give the rollouts in `rollouts` stored without a version the version in force at their dispatch
    (stored at - wall time): each update's version from its pause on, before the first the version it
    replaced ("0": the weights the server started with). Returns how many rows were tagged."""
    from django.db.models import DateTimeField, DurationField, ExpressionWrapper, F, Value
    from django.db.models.functions import Coalesce

    if not history:
        return 0
    wall = ExpressionWrapper(Coalesce(F("wall_ms"), Value(0.0)) * Value(timedelta(milliseconds=1)),
                             output_field=DurationField())
    qs = rollouts.filter(weight_version="").annotate(
        dispatched_at=ExpressionWrapper(F("created_at") - wall, output_field=DateTimeField()))
    n = qs.filter(dispatched_at__lt=history[0][0]).update(weight_version=history[0][2] or "0")
    for i, (start, version, _prev) in enumerate(history):
        q = qs.filter(dispatched_at__gte=start)
        if i + 1 < len(history):
            q = q.filter(dispatched_at__lt=history[i + 1][0])
        n += q.update(weight_version=version)
    return n


def backfill(endpoint_id) -> int:
    """After an update is recorded (on commit): the endpoint's rollouts stored without a version, e.g. while
    no history existed for their sink to tag them with, are tagged by dispatch time."""
    from controlplane.jobs.models import Rollout

    return tag_stored(Rollout.objects.filter(job__endpoint_id=endpoint_id), _history(endpoint_id))


class VersionTagger:
    """For the job sink: `stamp(result)` when a rollout arrives (cheap, in the event loop), `tag(batch)`
    on the DB thread before the batch is written (reads the endpoint's update history)."""

    def __init__(self, endpoint_id, job_id=None):
        self.endpoint_id = endpoint_id
        self.job_id = job_id
        self._arrived: dict[int, float] = {}
        self._stored_untagged = False  # rows went out without a version while there was no history

    def stamp(self, result) -> None:
        if not result.weight_version:
            self._arrived[id(result)] = time.time()

    def tag(self, batch) -> None:
        arrived = [(r, self._arrived.pop(id(r), None)) for r in batch]
        todo = [(r, t) for r, t in arrived if t is not None and not r.weight_version]
        if not todo and not self._stored_untagged:
            return
        history = _history(self.endpoint_id)
        if not history:
            self._stored_untagged = self._stored_untagged or bool(todo)
            return
        if self._stored_untagged and self.job_id is not None:  # the first update landed since: fix those rows
            from controlplane.jobs.models import Rollout

            tag_stored(Rollout.objects.filter(job_id=self.job_id), history)
            self._stored_untagged = False
        starts = [h[0].timestamp() for h in history]
        for r, t in todo:
            dispatched = t - (r.wall_ms or 0.0) / 1000.0
            i = bisect.bisect_right(starts, dispatched) - 1
            r.weight_version = history[i][1] if i >= 0 else (history[0][2] or "0")


def panel_context(request, job) -> dict:
    return {"versions": job_versions(job)}

