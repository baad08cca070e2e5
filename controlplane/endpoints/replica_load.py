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

from .services import normalize_base_url


LIVE_MESSAGE_TYPE = "endpoint.replicas"


def endpoint_group(endpoint_id: int) -> str:
    return f"endpoint-{endpoint_id}"


def _when(epoch) -> str | None:
    try:
        return datetime.fromtimestamp(float(epoch), tz=dt_timezone.utc).isoformat()
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def replica_load(endpoint, window_s: float | None = None) -> dict:
    from controlplane.jobs.models import JobMetricSample

    window_s = float(settings.REPLICA_LOAD_WINDOW_S if window_s is None else window_s)
    since = timezone.now() - timedelta(seconds=window_s)
    latest: dict[str, list] = {}
    rows = (JobMetricSample.objects.filter(job__endpoint=endpoint, t__gte=since, extra__has_key="replicas")
            .order_by("-t").values_list("job_id", "worker", "extra__replicas"))
    for job_id, worker, reps in rows.iterator(chunk_size=500):
        key = f"{job_id}/{worker}"
        if key not in latest and isinstance(reps, list):
            latest[key] = reps

    health = {normalize_base_url(r.get("url", "")): r for r in (endpoint.last_health or {}).get("replicas", [])
              if isinstance(r, dict)}
    urls = [normalize_base_url(u) for u in endpoint.all_base_urls]
    by_url: dict[str, list[dict]] = {u: [] for u in urls}
    for reps in latest.values():
        for r in reps:
            if isinstance(r, dict) and normalize_base_url(r.get("url", "")) in by_url:
                by_url[normalize_base_url(r["url"])].append(r)

    out = []
    for url in urls:
        seen = by_url[url]
        requests = sum(int(r.get("requests") or 0) for r in seen)
        errors = sum(int(r.get("errors") or 0) for r in seen)
        outs = [r for r in seen if r.get("state") == "out"]
        row = {
            "url": url,
            "state": "idle" if not seen else "out" if outs else "in",
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
