"""Endpoint domain logic: engine spec, health checks, pre-warm, redaction of the API key.

Health and pre-warm are blocking (one event loop per call) with short timeouts: they run in Celery tasks
(controlplane.endpoints.tasks; the web process only enqueues them) and management commands, never in
the web process nor on the engine's event loop. They never raise on network errors; they return
{"ok": False, "error": "..."} instead. The API key is sent as a bearer token and never appears in what
these functions return (errors are scrubbed of it).

Every call goes through the outbound gate (workers.outbound.fetch_sync: the operator's allow-list, the
resolved address checked and pinned, no redirects, at most PROBE_MAX_BYTES read, a total deadline), and they
report status codes, never a response body (the body of an internal page must not reach the user).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.utils import timezone

from workers import outbound
from workers.disclosure import with_detail
from workers.engine.types import EndpointSpec

HEALTH_TIMEOUT_S = 5.0
PROBE_MAX_BYTES = 1024 * 1024
PREWARM_TIMEOUT_S = 60.0
REDACTED = "********"


def nemo_gym_flavor(endpoint) -> str | None:
    from workers.nemo_gym import AGENT_FLAVOR, HEAD_FLAVOR

    return {"nemo_gym": HEAD_FLAVOR, "nemo_gym_agent": AGENT_FLAVOR}.get(endpoint.kind)


def endpoint_spec(endpoint) -> EndpointSpec:
    return EndpointSpec(
        base_urls=endpoint.all_base_urls,
        model=endpoint.model_name,
        api_flavor=nemo_gym_flavor(endpoint) or endpoint.api_flavor,
        api_key=endpoint.api_key or None,
        request_timeout_s=endpoint.request_timeout_s,
        connect_timeout_s=endpoint.connect_timeout_s,
        max_retries=endpoint.max_retries,
        rpm_limit=endpoint.rpm_limit,
        tpm_limit=endpoint.tpm_limit,
        max_response_bytes=settings.ENGINE_MAX_RESPONSE_BYTES,
        replica_affinity=getattr(endpoint, "replica_affinity", True),
        # hosted APIs have no /health: their model list says whether a replica answers
        health_path="/v1/models" if endpoint.kind == "openai" else "/health",
        probe_timeout_s=min(float(endpoint.connect_timeout_s), settings.REPLICA_PROBE_TIMEOUT_S),
        health_interval_s=settings.REPLICA_HEALTH_INTERVAL_S,
        probe_max_s=settings.REPLICA_PROBE_MAX_S,
    )


# --- redaction -------------------------------------------------------------------------------------
def normalize_base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000' (the model stores base URLs without the /v1 prefix)."""
    url = (url or "").strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def redact_text(text: str, *secrets: str | None) -> str:
    """Remove every occurrence of the given secrets from text (error messages, logs)."""
    text = str(text)
    for s in secrets:
        if s:
            text = text.replace(s, REDACTED)
    return text


def redacted_dict(endpoint) -> dict[str, Any]:
    """The endpoint as a plain dict safe to log or show: api_key replaced by has_api_key."""
    return {
        "id": endpoint.pk,
        "name": endpoint.name,
        "kind": endpoint.kind,
        "base_url": endpoint.base_url,
        "replica_urls": list(endpoint.replica_urls or []),
        "model_name": endpoint.model_name,
        "api_flavor": endpoint.api_flavor,
        "has_api_key": bool(endpoint.api_key),
        "request_timeout_s": endpoint.request_timeout_s,
        "connect_timeout_s": endpoint.connect_timeout_s,
        "max_retries": endpoint.max_retries,
        "rpm_limit": endpoint.rpm_limit,
        "tpm_limit": endpoint.tpm_limit,
        "last_health": endpoint.last_health,
        "last_health_at": endpoint.last_health_at.isoformat() if endpoint.last_health_at else None,
    }


# --- health ----------------------------------------------------------------------------------------
def _headers(endpoint) -> dict:
    h = {"Accept": "application/json"}
    if endpoint.api_key:
        h["Authorization"] = f"Bearer {endpoint.api_key}"
    return h


def _get(url: str, headers: dict, timeout: float, connect_timeout: float) -> outbound.Reply:
    return outbound.fetch_sync("GET", url, headers=headers, timeout_s=timeout, connect_timeout_s=connect_timeout,
                               max_bytes=PROBE_MAX_BYTES)


def _short_error(exc: outbound.OutboundError) -> str:
    """The product's words for a failed call ("cannot connect: Connection refused", "not an HTTP answer")."""
    return f"not called: {exc.reason}" if isinstance(exc, outbound.OutboundRefused) else exc.reason


def served_models(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """The model ids a server lists at /v1/models. Raises ValueError with a short reason when it cannot say."""
    headers = {"Accept": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    try:
        r = _get(normalize_base_url(base_url) + "/v1/models", headers, timeout, min(timeout, 5.0))
    except outbound.OutboundError as exc:
        raise ValueError(_short_error(exc)) from None
    if r.status != 200:
        raise ValueError(f"/v1/models answered HTTP {r.status}")
    try:
        return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, AttributeError) as exc:
        raise ValueError("/v1/models did not answer a model list") from exc


def _check_one(endpoint, base: str, timeout: float) -> dict:
    """Probe one replica: GET /health (vLLM), then /v1/models to see the model is served.
    Hosted APIs (kind openai) have no /health: only /v1/models."""
    base = normalize_base_url(base)
    out: dict[str, Any] = {"url": base, "ok": False}
    headers = _headers(endpoint)
    connect = min(timeout, endpoint.connect_timeout_s)
    t0 = time.perf_counter()
    try:
        health_status = None
        if endpoint.kind != "openai":
            r = _get(base + "/health", headers, timeout, connect)
            health_status = r.status
            out["health_status"] = r.status
            if r.status >= 500:
                out["error"] = f"/health answered HTTP {r.status}"
                return out
        try:
            r = _get(base + "/v1/models", headers, timeout, connect)
        except outbound.ResponseTooLarge:
            out["error"] = f"/v1/models answered more than {PROBE_MAX_BYTES} bytes"
            return out
        out["models_status"] = r.status
        out["latency_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        if r.status in (401, 403):
            out["error"] = f"/v1/models answered HTTP {r.status}: the API key is missing or wrong"
            return out
        if r.status != 200:
            if health_status == 200:
                out.update(ok=True, model_available=None, note=f"/v1/models answered HTTP {r.status}")
            else:
                out["error"] = f"/v1/models answered HTTP {r.status}"
            return out
        try:
            models = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            out["error"] = "/v1/models did not answer JSON"
            return out
        out["models"] = models[:20]
        out["model_available"] = endpoint.model_name in models
        if not out["model_available"]:
            out["error"] = with_detail(f"model {endpoint.model_name!r} is not served here",
                                       f"serves: {', '.join(map(str, models[:5])) or 'none'}")
            return out
        out["ok"] = True
        return out
    except outbound.OutboundError as exc:
        out["error"] = _short_error(exc)
        out["latency_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        return out
    except Exception as exc:  # never raise on a probe
        out["error"] = f"{type(exc).__name__}"
        return out


def check_health(endpoint, *, timeout: float = HEALTH_TIMEOUT_S, save: bool = True) -> dict:
    """Probe every replica of the endpoint. Returns
    {"ok", "checked_at", "error", "replicas": [{"url", "ok", "latency_ms", "health_status", "models_status",
    "model_available", "error"}...]} and, when save, stores it in endpoint.last_health/last_health_at.
    ok is True when every replica is healthy and serves the model. Never raises on network errors."""
    if endpoint.is_nemo_gym:
        from .nemo_gym import check_nemo_gym_health

        return check_nemo_gym_health(endpoint, timeout=timeout, save=save)
    urls = endpoint.all_base_urls
    if len(urls) == 1:
        replicas = [_check_one(endpoint, urls[0], timeout)]
    else:
        with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
            replicas = list(pool.map(lambda u: _check_one(endpoint, u, timeout), urls))
    for rep in replicas:
        if "error" in rep:
            rep["error"] = redact_text(rep["error"], endpoint.api_key)
    bad = [r for r in replicas if not r["ok"]]
    now = timezone.now()
    result = {
        "ok": not bad,
        "checked_at": now.isoformat(),
        "replicas": replicas,
        "error": "; ".join(f"{r['url']}: {r.get('error', 'unhealthy')}" for r in bad),
    }
    if save and endpoint.pk:
        endpoint.last_health = result
        endpoint.last_health_at = now
        type(endpoint).objects.filter(pk=endpoint.pk).update(last_health=result, last_health_at=now)
    return result


# --- pre-warm --------------------------------------------------------------------------------------
def _tiny_request(endpoint) -> tuple[str, dict]:
    flavor = endpoint.api_flavor
    if flavor == "completions":
        return "/v1/completions", {"model": endpoint.model_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    if flavor == "responses":
        return "/v1/responses", {"model": endpoint.model_name, "input": "Hello", "max_output_tokens": 16, "temperature": 0}
    return "/v1/chat/completions", {"model": endpoint.model_name, "messages": [{"role": "user", "content": "Hello"}],
                                    "max_tokens": 1, "temperature": 0}


def _agent_run_request(endpoint, sample_row: dict | None, agents: list[str] | None) -> tuple[list[str], str, dict]:
    """A NeMo Gym deployment: (its agents' base URLs, "/run", a body). The body is a real row of the job (the
    agent's resources server verifies what it gets) with a short answer; the agents are the job's, found through
    the head server."""
    from workers.nemo_gym.deployment import DeploymentError, resolve_sync
    from workers.nemo_gym.rows import agent_of, run_body

    try:
        deployment = resolve_sync(normalize_base_url(endpoint.base_url))
    except DeploymentError as exc:
        raise ValueError(str(exc)) from None
    found = deployment.agents
    names = [a for a in (agents or []) if a in found] or ([endpoint.model_name] if endpoint.model_name in found
                                                          else sorted(found))
    row = sample_row or {"responses_create_params": {"input": [{"role": "user", "content": "Hello"}]}}
    body = run_body(row, agent_of(row, endpoint.model_name or None) or (names[0] if names else None),
                    {"max_output_tokens": 16}, int(row.get("_ng_task_index", 0) or 0), 0)
    return [found[a] for a in names], "/run", body


def prewarm(endpoint, n: int = 4, *, timeout: float | None = None, sample_row: dict | None = None,
            agents: list[str] | None = None) -> dict:
    """Send n tiny generation requests, spread over the replicas (concurrently), so the first real
    rollouts do not pay for cold caches, lazy compilation or connection setup. A NeMo Gym deployment is warmed
    through its agents: `POST {agent}/run` with `sample_row` (a row of the job; `agents`: which agents, default
    the endpoint's, else all), the path a rollout takes (agent, model server, model, resources server).
    Returns {"ok", "sent", "succeeded", "latencies_ms": [...], "errors": [...]}; never raises on
    network errors."""
    if getattr(endpoint, "is_nemo_gym", False):
        try:
            urls, path, body = _agent_run_request(endpoint, sample_row, agents)
        except ValueError as exc:
            return {"ok": False, "sent": 0, "succeeded": 0, "latencies_ms": [], "errors": [str(exc)[:300]]}
        if not urls:
            return {"ok": False, "sent": 0, "succeeded": 0, "latencies_ms": [],
                    "errors": [f"the deployment at {endpoint.base_url} has no agent"]}
    else:
        path, body = _tiny_request(endpoint)
        urls = [normalize_base_url(u) for u in endpoint.all_base_urls]
    refused = [f"{u}: not called: {why}" for u in urls if (why := outbound.url_problem(u, resolve=False))]
    if refused:  # the gate refuses each call too; this only spares n refusals of the same URL
        return {"ok": False, "sent": 0, "succeeded": 0, "latencies_ms": [], "errors": refused[:20]}
    timeout = timeout or min(endpoint.request_timeout_s, PREWARM_TIMEOUT_S)
    headers = {**_headers(endpoint), "Content-Type": "application/json"}

    def one(i: int):
        url = urls[i % len(urls)] + path
        t0 = time.perf_counter()
        try:
            r = outbound.fetch_sync("POST", url, json=body, headers=headers, timeout_s=timeout, max_bytes=PROBE_MAX_BYTES,
                                    connect_timeout_s=min(timeout, endpoint.connect_timeout_s))
        except outbound.OutboundError as exc:
            return None, f"{url}: {_short_error(exc)}"
        ms = round((time.perf_counter() - t0) * 1000, 1)
        if r.status != 200:  # the status only: the body may be an internal page's
            return None, f"{url}: HTTP {r.status}"
        return ms, None

    n = max(0, int(n))
    if n == 0:
        return {"ok": True, "sent": 0, "succeeded": 0, "latencies_ms": [], "errors": []}
    with ThreadPoolExecutor(max_workers=min(n, 16)) as pool:
        results = list(pool.map(one, range(n)))
    latencies = [ms for ms, err in results if err is None]
    errors = [redact_text(err, endpoint.api_key) for _ms, err in results if err is not None]
    return {"ok": not errors, "sent": n, "succeeded": len(latencies), "latencies_ms": latencies, "errors": errors[:20]}
