"""NeMo Gym endpoints: a deployment (its head server; the agents are discovered) or one agent server.

The endpoint's model_name is the agent that rows without their own `agent_ref` go to. Health of a
deployment = its head server answers and lists its servers, each of which answers; only names, kinds and
addresses are kept (the deployment's config holds secrets such as policy_api_key: never stored). Every server
the head lists is probed through the outbound gate: a config cannot make a worker scan addresses the operator
does not allow (they are reported "not called")."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from django.utils import timezone

from workers import outbound
from workers.nemo_gym.deployment import DeploymentError, resolve_sync

PROBE_MAX_BYTES = 256 * 1024  # FastAPI's /docs page is a few kB


def _probe(url: str, timeout: float) -> dict:
    """An agent / resources server is up when its HTTP server answers at all (NeMo Gym servers have no
    /health route; FastAPI answers 404 for an unknown path)."""
    t0 = timezone.now()
    try:
        resp = outbound.fetch_sync("GET", f"{url}/docs", timeout_s=timeout, max_bytes=PROBE_MAX_BYTES)
        ms = (timezone.now() - t0).total_seconds() * 1000.0
        return {"url": url, "ok": resp.status < 500, "latency_ms": round(ms, 1), "health_status": resp.status}
    except outbound.ResponseTooLarge:  # it answered: up, whatever its page
        return {"url": url, "ok": True, "latency_ms": round((timezone.now() - t0).total_seconds() * 1000.0, 1)}
    except outbound.OutboundRefused as exc:
        return {"url": url, "ok": False, "error": f"not called: {exc.reason}"}
    except outbound.OutboundError as exc:
        return {"url": url, "ok": False, "error": exc.reason}


def discover(endpoint, timeout: float = 5.0) -> dict:
    """{"head_url", "servers": [...]} of a deployment endpoint (raises DeploymentError)."""
    return resolve_sync(endpoint.base_url, timeout_s=timeout).public()


def check_nemo_gym_health(endpoint, *, timeout: float = 5.0, save: bool = True) -> dict:
    now = timezone.now()
    result: dict = {"ok": False, "checked_at": now.isoformat(), "replicas": [], "error": "", "agents": []}
    if endpoint.kind == endpoint.Kind.NEMO_GYM:
        try:
            dep = discover(endpoint, timeout)
        except DeploymentError as exc:
            result["error"] = str(exc)
            dep = None
        if dep is not None:
            servers = dep["servers"]
            with ThreadPoolExecutor(max_workers=min(8, max(1, len(servers)))) as pool:
                probes = list(pool.map(lambda s: _probe(s["url"], timeout), servers))
            for server, probe in zip(servers, probes):
                server.update({"ok": probe["ok"], "latency_ms": probe.get("latency_ms"), "error": probe.get("error", "")})
            result["servers"] = servers
            result["agents"] = [s["name"] for s in servers if s["kind"] == "agent"]
            result["replicas"] = [{"url": endpoint.base_url, "ok": True, "model_available": endpoint.model_name in result["agents"]
                                   if endpoint.model_name else True}]
            bad = [s for s in servers if not s["ok"]]
            missing = endpoint.model_name and endpoint.model_name not in result["agents"]
            result["ok"] = not bad and not missing
            result["error"] = "; ".join([f"{s['name']} ({s['url']}) " + (s["error"] if s["error"].startswith("not called")
                                                                          else "does not answer") for s in bad] +
                                        ([f"no agent named {endpoint.model_name!r}"] if missing else []))
    else:
        probe = _probe(endpoint.base_url.rstrip("/"), timeout)
        result["replicas"] = [probe]
        result["ok"] = probe["ok"]
        result["agents"] = [endpoint.model_name] if endpoint.model_name else []
        result["error"] = "" if probe["ok"] else f"{endpoint.base_url}: {probe.get('error', 'unhealthy')}"
    if save and endpoint.pk:
        type(endpoint).objects.filter(pk=endpoint.pk).update(last_health=result, last_health_at=now)
        endpoint.last_health, endpoint.last_health_at = result, now
    return result
