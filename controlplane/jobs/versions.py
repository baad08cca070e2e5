"""Weight versions of rollouts: per-job counts and staleness, and tagging rollouts from servers that
report no version. (The jobs app's: it owns the rollouts; the endpoints app records the updates and calls
`after_update` through the hook this app registers in its ready().)

A rollout's version is what the server reported (header X-Weight-Version, or the body's
`weight_version`). vLLM reports none: for an endpoint with a weight-update history, such a rollout gets
the version of the update in force when it was dispatched (dispatch = when the sink received it minus
its wall time), counting an update from the moment its pause was sent.

Version lag (staleness) of a rollout = the endpoint's current version - the rollout's version, for
numeric versions (the control plane numbers the versions it assigns 1, 2, 3...); '' = unknown.
"""
from __future__ import annotations

import bisect
from datetime import timedelta, timezone as dt_timezone, datetime
import time

from django.db.models import Count, Q

from controlplane.endpoints.models import WeightVersion

from .models import Rollout


def _num(v: str):
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def job_versions(job) -> dict:
    """{"current": str, "versions": [{"version", "ok", "failed", "total", "lag", "stale_marked", "spans_update",
    "past_bound"}...] (newest first), "tagged": n, "untagged": n, "mean_lag": float|None, "max_lag": int|None,
    "stale": n (lag > 0), "max_version_lag": the job's bound, "stale_policy", "past_bound": ok rows of versions past
    the bound (the stream hands none out), "stale_marked": rows kept and marked, "spans_update": rows that ran
    across an update}."""
    rows = (Rollout.objects.filter(job=job).values("weight_version")
            .annotate(ok=Count("id", filter=Q(status=Rollout.Status.OK)),
                      failed=Count("id", filter=~Q(status=Rollout.Status.OK)),
                      marked=Count("id", filter=Q(stale=True)), spans=Count("id", filter=Q(spans_update=True))))
    rows = list(rows)
    extra = {r["weight_version"] or "": (r["marked"], r["spans"]) for r in rows}
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
        bound = getattr(job, "max_version_lag", None)
        versions.append({"version": v, "ok": ok, "failed": failed, "total": ok + failed, "lag": lag,
                         "stale_marked": extra[v][0], "spans_update": extra[v][1],
                         "past_bound": bound is not None and lag is not None and lag > bound})
        if lag is not None:
            lag_sum += lag * (ok + failed)
            lag_n += ok + failed
            stale += (ok + failed) if lag > 0 else 0
            max_lag = lag if max_lag is None else max(max_lag, lag)
    versions.sort(key=lambda d: (_num(d["version"]) is None, -(_num(d["version"]) or 0), d["version"]))
    untagged = sum(by_version.get("", (0, 0)))
    return {"current": current, "versions": versions, "tagged": sum(d["total"] for d in versions),
            "max_version_lag": getattr(job, "max_version_lag", None), "stale_policy": getattr(job, "stale_policy", ""),
            "past_bound": sum(d["ok"] for d in versions if d["past_bound"]),
            "stale_marked": sum(m for m, _ in extra.values()), "spans_update": sum(s for _, s in extra.values()),
            "untagged": untagged, "mean_lag": round(lag_sum / lag_n, 3) if lag_n else None, "max_lag": max_lag,
            "stale": stale}


def _received():
    """A row's arrival at its sink: `arrived_at` where its sink stored it, else its commit time (created_at), later
    than the arrival by up to a flush interval: a rollout dispatched just before a pause would count as after."""
    from django.db.models import F
    from django.db.models.functions import Coalesce

    return Coalesce(F("arrived_at"), F("created_at"))


def _dispatched():
    """A row's dispatch: its arrival less its wall time."""
    from django.db.models import DateTimeField, DurationField, ExpressionWrapper, F, Value
    from django.db.models.functions import Coalesce

    wall = ExpressionWrapper(Coalesce(F("wall_ms"), Value(0.0)) * Value(timedelta(milliseconds=1)),
                             output_field=DurationField())
    return ExpressionWrapper(_received() - wall, output_field=DateTimeField())


def _history(endpoint_id) -> list[tuple]:
    """[(started_at, version, previous_version)] oldest first."""
    return list(WeightVersion.objects.filter(endpoint_id=endpoint_id).order_by("started_at", "id")
                .values_list("started_at", "version", "previous_version"))


def tag_stored(rollouts, history: list[tuple]) -> int:
    """Give the rollouts in `rollouts` stored without a version the version in force at their dispatch
    (arrival at the sink - wall time, _dispatched): each update's version from its pause on, before the first the version it
    replaced ("0": the weights the server started with). Returns how many rows were tagged."""
    if not history:
        return 0
    qs = rollouts.filter(weight_version="").annotate(dispatched_at=_dispatched())
    n = qs.filter(dispatched_at__lt=history[0][0]).update(weight_version=history[0][2] or "0")
    for i, (start, version, _prev) in enumerate(history):
        q = qs.filter(dispatched_at__gte=start)
        if i + 1 < len(history):
            q = q.filter(dispatched_at__lt=history[i + 1][0])
        n += q.update(weight_version=version)
    _tag_completed(rollouts, history)
    return n


def _tag_completed(rollouts, history: list[tuple]) -> None:
    """The version in force when each row (stored without one) completed, i.e. was stored; and
    spans_update where it differs from the version at dispatch."""
    from django.db.models import F

    qs = rollouts.filter(completed_version="").annotate(received=_received())
    qs.filter(received__lt=history[0][0]).update(completed_version=history[0][2] or "0")
    for i, (start, version, _prev) in enumerate(history):
        q = qs.filter(received__gte=start)
        if i + 1 < len(history):
            q = q.filter(received__lt=history[i + 1][0])
        q.update(completed_version=version)
    (rollouts.filter(spans_update=False).exclude(weight_version="").exclude(completed_version="")
     .exclude(completed_version=F("weight_version")).update(spans_update=True))


def backfill(endpoint_id) -> int:
    """After the endpoint's first update is recorded (on commit): its rollouts stored without a version (no
    history existed for their sink to tag them with) are tagged by dispatch time. Once per endpoint."""
    return tag_stored(Rollout.objects.filter(job__endpoint_id=endpoint_id), _history(endpoint_id))


def last_rollout_id() -> int:
    """The newest rollout id (the primary key's index: one row read), taken when an update's pause is sent."""
    return Rollout.objects.order_by("-id").values_list("id", flat=True).first() or 0


def after_update(endpoint_id, since_id: int) -> int:
    """After an update is recorded (on commit). Rollouts are tagged when they are written (VersionTagger, from
    the endpoint's version intervals), so only two kinds of rows need a look, never the whole table:
    * the endpoint's first update: rows stored before any history existed (`backfill`, once);
    * rows written while this update ran (id > `since_id`, taken when its pause was sent) and dispatched after
      its pause: their sink tagged them with the previous version before this one was recorded.
    The second costs what was written during the update (a range of the primary key), whatever the number of
    rollouts stored before. Returns how many rows were (re)tagged."""
    history = _history(endpoint_id)
    if not history:
        return 0
    if len(history) == 1:
        return backfill(endpoint_id)
    start, version, previous = history[-1]
    written = (Rollout.objects.filter(pk__gt=since_id, job__endpoint_id=endpoint_id,
                                      weight_version__in=["", previous or "0"])
               .annotate(dispatched_at=_dispatched(), received=_received()))
    ids = list(written.filter(dispatched_at__gte=start).values_list("pk", flat=True))
    # dispatched before the pause, completed after it: ran across the update
    spanning = list(written.filter(dispatched_at__lt=start, received__gte=start).values_list("pk", flat=True))
    if spanning:
        Rollout.objects.filter(pk__in=spanning).update(completed_version=version, spans_update=True)
    if not ids:
        return 0
    return Rollout.objects.filter(pk__in=ids).update(weight_version=version, completed_version=version,
                                                     spans_update=False)


class VersionTagger:
    """For the job sink: `stamp(result)` when a rollout arrives (cheap, in the event loop), `tag(batch)`
    on the DB thread before the batch is written (reads the endpoint's update history), `written(batch)`
    once it committed. `tag` may run again for the same batch (a write retried after a deadlock)."""

    def __init__(self, endpoint_id, job_id=None):
        self.endpoint_id = endpoint_id
        self.job_id = job_id
        self._arrived: dict[int, float] = {}
        self._stored_untagged = False  # rows went out without a version while there was no history

    def stamp(self, result) -> None:
        self._arrived[id(result)] = time.time()

    def arrived_at(self, result):
        """When the sink received `result` (stored as Rollout.arrived_at), None if it was not stamped."""
        t = self._arrived.get(id(result))
        return None if t is None else datetime.fromtimestamp(t, tz=dt_timezone.utc)

    def tag(self, batch) -> None:
        """Each rollout's version at dispatch (for servers that report none) and at completion (its arrival):
        a rollout that ran across an update gets two different versions (Rollout.spans_update)."""
        todo = [(r, t) for r in batch if (t := self._arrived.get(id(r))) is not None]
        if not todo:
            return
        history = _history(self.endpoint_id)
        if not history:
            return
        starts = [h[0].timestamp() for h in history]

        def at(ts):
            i = bisect.bisect_right(starts, ts) - 1
            return history[i][1] if i >= 0 else (history[0][2] or "0")

        for r, t in todo:
            if not r.weight_version:
                r.weight_version = at(t - (r.wall_ms or 0.0) / 1000.0)
            r.completed_version = at(t)

    def written(self, batch) -> None:
        """After the batch committed. Rows stored without a version (no history when they were tagged) are
        fixed once the endpoint's first update is recorded. The history is read again after the commit: an
        update recorded between `tag` and the commit ran its backfill before these rows were visible to it,
        and one recorded after this read will see them."""
        self._stored_untagged = self._stored_untagged or any(
            not r.weight_version for r in batch if id(r) in self._arrived)
        if self._stored_untagged and self.job_id is not None:
            history = _history(self.endpoint_id)
            if history:
                tag_stored(Rollout.objects.filter(job_id=self.job_id), history)
                self._stored_untagged = False
        for r in batch:
            self._arrived.pop(id(r), None)


def panel_context(request, job) -> dict:
    return {"versions": job_versions(job)}

