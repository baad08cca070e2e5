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


class VersionTagger:
    """For the job sink: `stamp(result)` when a rollout arrives (cheap, in the event loop), `tag(batch)`
    on the DB thread before the batch is written (reads the endpoint's update history)."""

    def __init__(self, endpoint_id):
        self.endpoint_id = endpoint_id
        self._arrived: dict[int, float] = {}

    def stamp(self, result) -> None:
        if not result.weight_version:
            self._arrived[id(result)] = time.time()

    def tag(self, batch) -> None:
        arrived = [(r, self._arrived.pop(id(r), None)) for r in batch]
        todo = [(r, t) for r, t in arrived if t is not None and not r.weight_version]
        if not todo:
            return
        history = list(WeightVersion.objects.filter(endpoint_id=self.endpoint_id).order_by("started_at", "id")
                       .values_list("started_at", "version", "previous_version"))
        if not history:
            return
        starts = [h[0].timestamp() for h in history]
        for r, t in todo:
            dispatched = t - (r.wall_ms or 0.0) / 1000.0
            i = bisect.bisect_right(starts, dispatched) - 1
            r.weight_version = history[i][1] if i >= 0 else (history[0][2] or "0")


def panel_context(request, job) -> dict:
    return {"versions": job_versions(job)}


def backfill(wv: WeightVersion) -> int:
    """When an update is recorded: rollouts of the endpoint's jobs that were stored without a version
    before this record existed (their sink had no history to tag them with) get one by dispatch time
    (stored at - wall time): this update's version from its pause on, else the version before it.
    Returns how many rows were tagged."""
    from django.db.models import DateTimeField, DurationField, ExpressionWrapper, F, Value
    from django.db.models.functions import Coalesce

    from controlplane.jobs.models import Rollout

    prior = (WeightVersion.objects.filter(endpoint_id=wv.endpoint_id, started_at__lt=wv.started_at)
             .exclude(pk=wv.pk).order_by("-started_at").first())
    older = prior.version if prior else (wv.previous_version or "0")
    qs = Rollout.objects.filter(job__endpoint_id=wv.endpoint_id, weight_version="", created_at__lte=wv.applied_at)
    if prior is not None:
        qs = qs.filter(created_at__gt=prior.started_at)
    wall = ExpressionWrapper(Coalesce(F("wall_ms"), Value(0.0)) * Value(timedelta(milliseconds=1)),
                             output_field=DurationField())
    dispatched = ExpressionWrapper(F("created_at") - wall, output_field=DateTimeField())
    qs = qs.annotate(dispatched_at=dispatched)
    n = qs.filter(dispatched_at__gte=wv.started_at).update(weight_version=wv.version)
    n += qs.filter(dispatched_at__lt=wv.started_at).update(weight_version=older)
    return n
