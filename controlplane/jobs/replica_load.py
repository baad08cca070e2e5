"""Per-replica load of an endpoint, as the engine runs that use it see it.

Every run (a chunk on a worker) puts its replica table in each progress tick (`extra["replicas"]`: in flight,
requests, answered, errors, in or out of rotation and since when; counters cumulative for the run), and the
DbSink stores the tick as a JobMetricSample. The endpoint's load is the latest tick of every run seen in the
last REPLICA_LOAD_WINDOW_S, summed per replica: in flight, requests and errors add up; a replica is "out"
when a run has it out of rotation (since the earliest such run took it out), "in" when every run has it in,
"idle" when no run reported in the window. The last health check (`last_health`) is shown beside it.

Live: a run whose tick carries a replica table nudges the endpoint's group (`endpoint_group`, message type
`endpoint.replicas`) once its sample is stored; the endpoint page's socket answers a nudge with this load,
read again from the database, so the live table and a reload show the same sums.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.utils import timezone

from controlplane.endpoints.services import normalize_base_url

from .models import JobMetricSample


LIVE_MESSAGE_TYPE = "endpoint.replicas"
RUN_FRESH_S = 5.0  # a run whose latest tick is older holds nothing in flight (paused, cancelled, done)


def endpoint_group(endpoint_id: int) -> str:
    return f"endpoint-{endpoint_id}"


def _when(epoch) -> str | None:
    try:
        return datetime.fromtimestamp(float(epoch), tz=dt_timezone.utc).isoformat()
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def replica_load(endpoint, window_s: float | None = None) -> dict:

    window_s = float(settings.REPLICA_LOAD_WINDOW_S if window_s is None else window_s)
    since = timezone.now() - timedelta(seconds=window_s)
    fresh_after = timezone.now() - timedelta(seconds=RUN_FRESH_S)
    # the latest tick of every run: a series ("<worker> chunk <index>") holds one run after another when the
    # same worker runs the chunk again (resumed): its elapsed time starting over begins a new run
    current: dict[str, tuple] = {}  # series -> (elapsed_s, t, replicas) of its run now
    ended: list[tuple] = []  # (t, replicas) of runs a later run of the same series followed
    rows = (JobMetricSample.objects.filter(job__endpoint=endpoint, t__gte=since, extra__has_key="replicas")
            .order_by("t").values_list("job_id", "worker", "extra__replicas", "t", "elapsed_s"))
    for job_id, worker, reps, t, elapsed in rows.iterator(chunk_size=500):
        if not isinstance(reps, list):
            continue
        key = f"{job_id}/{worker}"
        prev = current.get(key)
        if prev is not None and (elapsed or 0.0) < (prev[0] or 0.0):
            ended.append((prev[1], prev[2]))
        current[key] = (elapsed, t, reps)
    latest: dict[str, list] = {}
    stopped: set[str] = set()  # runs whose latest tick is old: paused, cancelled, finished or gone
    for i, (t, reps) in enumerate([(v[1], v[2]) for v in current.values()] + ended):
        latest[str(i)] = reps
        if t < fresh_after:
            stopped.add(str(i))

    health = {normalize_base_url(r.get("url", "")): r for r in (endpoint.last_health or {}).get("replicas", [])
              if isinstance(r, dict)}
    urls = [normalize_base_url(u) for u in endpoint.all_base_urls]
    by_url: dict[str, list[dict]] = {u: [] for u in urls}
    for key, reps in latest.items():
        for r in reps:
            if isinstance(r, dict) and normalize_base_url(r.get("url", "")) in by_url:
                if key in stopped:  # its counts stand; nothing of it is in flight any more
                    r = dict(r, in_flight=0, _stopped=True)
                by_url[normalize_base_url(r["url"])].append(r)

    out = []
    for url in urls:
        seen = by_url[url]
        requests = sum(int(r.get("requests") or 0) for r in seen)
        errors = sum(int(r.get("errors") or 0) for r in seen)
        outs = [r for r in seen if r.get("state") == "out"]
        live = [r for r in seen if not r.get("_stopped")]
        row = {
            "url": url,
            "state": "idle" if not live else "out" if outs else "in",
            "since": None, "reason": "",
            "runs": len(seen),
            "in_flight": sum(int(r.get("in_flight") or 0) for r in seen),
            "requests": requests,
            "ok": sum(int(r.get("ok") or 0) for r in seen),
            "errors": errors,
            "error_rate": round(errors / requests, 4) if requests else None,
            "times_out": sum(int(r.get("times_out") or 0) for r in seen),
            "last_error": next((r.get("last_error") for r in seen if r.get("last_error")), ""),
            "health": {k: health[url].get(k) for k in ("ok", "error", "latency_ms") if k in health[url]} if url in health else None,
        }
        if outs:
            first = min(outs, key=lambda r: float(r.get("since") or 0))
            row["since"], row["reason"] = _when(first.get("since")), first.get("reason") or ""
        elif seen:
            row["since"] = _when(max(float(r.get("since") or 0) for r in seen))
        out.append(row)
    total = sum(r["requests"] for r in out)
    for r in out:
        r["share"] = round(r["requests"] / total, 4) if total else None
    return {"window_s": window_s, "runs": len(latest), "in_rotation": sum(r["state"] != "out" for r in out),
            "replicas": out, "checked_at": (endpoint.last_health or {}).get("checked_at")}


RUN_HEALTH_WINDOW_S = 900.0  # a job's requests this recent say whether the endpoint answers


def run_health(endpoint) -> dict | None:
    """What the latest run of any job on the endpoint saw of it (its replica table, single URL included):
    {"ok": some replica answered requests and none is out of rotation, "at": datetime, "answered", "errors"};
    None when no run used it in the last RUN_HEALTH_WINDOW_S. Shown beside (or instead of) the last check."""
    row = (JobMetricSample.objects.filter(job__endpoint=endpoint, extra__has_key="replicas",
                                          t__gte=timezone.now() - timedelta(seconds=RUN_HEALTH_WINDOW_S))
           .order_by("-t").values_list("t", "extra__replicas").first())
    if row is None or not isinstance(row[1], list):
        return None
    reps = [r for r in row[1] if isinstance(r, dict)]
    answered = sum(int(r.get("ok") or 0) for r in reps)
    errors = sum(int(r.get("errors") or 0) for r in reps)
    out = any(r.get("state") == "out" for r in reps)
    return {"ok": answered > 0 and not out, "at": row[0], "answered": answered, "errors": errors}
