"""Model-server operations on every replica of an endpoint, through the dedicated `OpsClient`.

Each function takes the replicas' base URLs and returns one `OpResult` per request (per replica, and per
step for a weight update), all carrying the trace id of the operation. Replicas are handled
concurrently; a replica that does not answer within the operation's timeout is reported (ok=False,
timed_out=True), never waited on past it.

The weight update is pause(keep) -> update -> resume on each replica, and resume is sent whether the
update succeeded or not (a replica left paused would hold every rollout forever).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .client import OpsClient, OpResult, new_trace_id

PAUSE_MODES = ("abort", "wait", "keep")
SERVER_KINDS = ("simulator", "vllm")
# How a vLLM server reloads its weights without a weight-transfer engine (NCCL/IPC, which CPU servers lack):
# the worker's reload_weights method through the dev-mode /collective_rpc route, in place, from the given
# directory of safetensors (which then becomes the model's path) or, without one, from the model's own
# path (a trainer that overwrote its checkpoint there). vLLM's chat/completions answers carry no weight
# version, so after the reload the control plane's version is set on the server (/update_weight_version,
# readable at /weight_info) and rollouts are tagged by dispatch time (controlplane.jobs.versions).
VLLM_RELOAD_METHOD = "reload_weights"


async def _each(urls: list[str], fn) -> list:
    out = await asyncio.gather(*(fn(u) for u in urls))
    flat: list[OpResult] = []
    for item in out:
        flat.extend(item if isinstance(item, list) else [item])
    return flat


async def simple(client: OpsClient, urls: list[str], kind: str, *, trace_id: str | None = None,
                 params: dict | None = None, json_body: Any = None) -> list[OpResult]:
    """health, reset_prefix_cache, pause, resume, sleep, wake_up, is_paused ... on every replica."""
    method, path = ROUTES[kind]
    trace_id = trace_id or new_trace_id()
    return await _each(urls, lambda u: client.call(u, method, path, kind=kind, params=params, json_body=json_body,
                                                    trace_id=trace_id))


ROUTES = {
    "health": ("GET", "/health"),
    "reset_prefix_cache": ("POST", "/reset_prefix_cache"),
    "pause": ("POST", "/pause"),
    "resume": ("POST", "/resume"),
    "sleep": ("POST", "/sleep"),
    "wake_up": ("POST", "/wake_up"),
    "is_paused": ("GET", "/is_paused"),
    "is_sleeping": ("GET", "/is_sleeping"),
    "weight_version": ("GET", "/weight_version"),
    "version": ("GET", "/version"),
}


async def pause(client, urls, mode: str = "keep", *, trace_id=None) -> list[OpResult]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return await simple(client, urls, "pause", trace_id=trace_id, params={"mode": mode})


async def sleep(client, urls, level: int = 1, *, trace_id=None) -> list[OpResult]:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    return await simple(client, urls, "sleep", trace_id=trace_id, params={"level": str(level)})


def prewarm_request(model: str, flavor: str) -> tuple[str, dict]:
    if flavor == "completions":
        return "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    if flavor == "responses":
        return "/v1/responses", {"model": model, "input": "Hello", "max_output_tokens": 16, "temperature": 0}
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hello"}],
                                    "max_tokens": 1, "temperature": 0}


async def prewarm(client, urls, count: int, *, model: str, flavor: str = "chat_completions",
                  trace_id=None) -> list[OpResult]:
    """Exactly `count` tiny generation requests, spread round-robin over the replicas, all at once."""
    count = int(count)
    if count < 0:
        raise ValueError(f"pre-warm count must be >= 0, got {count}")
    path, body = prewarm_request(model, flavor)
    trace_id = trace_id or new_trace_id()
    return list(await asyncio.gather(*(
        client.call(urls[i % len(urls)], "POST", path, kind="prewarm", json_body=body, trace_id=trace_id)
        for i in range(count))))


def update_request(server: str, *, path: str = "", checkpoint_id: str = "",
                   version: int | None = None) -> tuple[str, str, dict]:
    """(method, route, body) of the update step for a server kind.

    simulator: POST /update_weights {"weight_version": v, "path": ..., "checkpoint_id": ...}
    vllm:      POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": path}}: the
               worker reloads the weights from disk (the model's own directory when no path is given),
               then POST /update_weight_version {"new_version": v}.
    """
    if server == "simulator":
        body: dict[str, Any] = {}
        if version is not None:
            body["weight_version"] = int(version)
        if path:
            body["path"] = path
        if checkpoint_id:
            body["checkpoint_id"] = checkpoint_id
        return "POST", "/update_weights", body
    if server == "vllm":
        kwargs: dict[str, Any] = {}
        if path:
            kwargs["weights_path"] = path
        return "POST", "/collective_rpc", {"method": VLLM_RELOAD_METHOD, "kwargs": kwargs}
    raise ValueError(f"unknown server kind {server!r}; known: {', '.join(SERVER_KINDS)}")


@dataclass
class UpdateReport:
    trace_id: str
    ok: bool
    steps: list[OpResult] = field(default_factory=list)
    failed_replicas: list[str] = field(default_factory=list)
    unanswered_replicas: list[str] = field(default_factory=list)
    not_resumed: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"trace_id": self.trace_id, "ok": self.ok, "failed_replicas": self.failed_replicas,
                "unanswered_replicas": self.unanswered_replicas, "not_resumed": self.not_resumed,
                "steps": [s.to_dict() for s in self.steps]}


async def update_weights_one(client, url: str, *, server: str, trace_id: str, path: str = "",
                             checkpoint_id: str = "", version: int | None = None,
                             pause_mode: str = "keep") -> list[OpResult]:
    """pause(mode) -> update -> resume on one replica; resume is sent even when pause or update fail, or the
    run is cancelled at its deadline (run(deadline_s=...))."""
    steps: list[OpResult] = []
    try:
        steps.append(await client.call(url, "POST", "/pause", kind="pause", params={"mode": pause_mode},
                                       trace_id=trace_id))
        if steps[0].ok:
            method, route, body = update_request(server, path=path, checkpoint_id=checkpoint_id, version=version)
            upd = await client.call(url, method, route, kind="update_weights", json_body=body, trace_id=trace_id)
            if upd.ok and server == "vllm" and isinstance(upd.body, dict) and upd.body.get("results") is not None:
                results = upd.body["results"]
                if any(isinstance(r, dict) and r.get("error") for r in results or []):
                    upd.ok, upd.error = False, f"reload failed on a worker: {results}"[:500]
            steps.append(upd)
            if upd.ok and server == "vllm" and version is not None:
                # vLLM (>= 0.3x, dev mode) keeps a weight version of its own (GET /weight_info): set it to ours
                steps.append(await client.call(url, "POST", "/update_weight_version", kind="set_weight_version",
                                               json_body={"new_version": str(version)}, trace_id=trace_id))
    finally:
        steps.append(await client.call(url, "POST", "/resume", kind="resume", trace_id=trace_id))
    return steps


async def update_weights(client, urls, *, server: str, path: str = "", checkpoint_id: str = "",
                         version: int | None = None, trace_id: str | None = None,
                         pause_mode: str = "keep") -> UpdateReport:
    """The weight update on every replica at once. ok only when every replica paused, updated and resumed."""
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
    update_request(server, path=path, checkpoint_id=checkpoint_id, version=version)  # validates server
    trace_id = trace_id or new_trace_id()
    per_replica = await asyncio.gather(*(
        update_weights_one(client, u, server=server, trace_id=trace_id, path=path, checkpoint_id=checkpoint_id,
                           version=version, pause_mode=pause_mode) for u in urls))
    report = UpdateReport(trace_id=trace_id, ok=True)
    for url, steps in zip(urls, per_replica):
        report.steps.extend(steps)
        if not all(s.ok for s in steps):
            report.ok = False
            report.failed_replicas.append(url.rstrip("/"))
        if any(s.timed_out for s in steps):
            report.unanswered_replicas.append(url.rstrip("/"))
        if not steps[-1].ok:
            report.not_resumed.append(url.rstrip("/"))
    return report


async def detect_server(client, url: str) -> str:
    """'simulator' when /version says so, else 'vllm'."""
    r = await client.call(url, "GET", "/version", kind="version", timeout_s=5.0)
    if r.ok and isinstance(r.body, dict) and r.body.get("simulator"):
        return "simulator"
    return "vllm"


def run(coro_fn, deadline_s: float | None = None, **client_kw):
    """Run `coro_fn(client)` with a fresh OpsClient on a fresh event loop (for sync callers). With deadline_s,
    the whole run is cancelled at that total deadline (a weight update's `finally` still sends its resume) and
    TimeoutError raised."""
    async def main():
        async with OpsClient(**client_kw) as client:
            return await coro_fn(client)

    async def bounded():
        try:
            return await asyncio.wait_for(main(), deadline_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"passed its total deadline of {deadline_s:g} s") from None

    return asyncio.run(main() if deadline_s is None else bounded())
