"""A dedicated HTTP client for model-server operations ("ops"; never shared with rollout traffic).

Why a client of its own: rollout traffic holds long streaming responses open. An ops call sent
through the same connection pool waits *on the client side* for a free connection, so a weight update
that takes 0.4 s on the server can take many seconds end to end. This client therefore has:

* its own session (made by the outbound gate, workers.outbound: allow-list, checked and pinned addresses, no
  redirects, capped reads), created here and never handed to rollout code;
* no keep-alive reuse (`force_close=True`): every operation opens a fresh connection, so it never waits
  behind a connection that a stream or a half-read response still holds;
* a timeout per operation kind (a replica that does not answer is reported, not waited on forever);
* bounded retries on 5xx answers and transport errors (refused / reset connections), never on a 4xx
  and never on a timeout (the operation already spent its budget);
* a trace id header (`X-Trace-Id`) on every request, and three timings per operation:
  `wall_ms` measured here (from the call to the full response), `rpc_ms` the server's own time (from its
  `Server-Timing: rpc;dur=` header when it sends one, else time to first byte: request headers sent ->
  response headers received), and `queue_ms = wall_ms - rpc_ms` (time spent on the client side: waiting
  for a connection, connecting, the event loop).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from workers import outbound
from workers.disclosure import with_detail

TRACE_HEADER = "X-Trace-Id"
DEFAULT_TIMEOUTS_S = {
    "health": 5.0, "is_paused": 5.0, "weight_version": 5.0, "is_sleeping": 5.0, "server_info": 10.0,
    "prewarm": 60.0, "reset_prefix_cache": 30.0, "pause": 120.0, "resume": 30.0,
    "update_weights": 600.0, "sleep": 120.0, "wake_up": 120.0, "collective_rpc": 600.0,
}
DEFAULT_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 1 << 20  # an ops answer is small JSON; a larger one is refused, not buffered
_SERVER_TIMING = re.compile(r"(?:^|,)\s*rpc\s*;(?:[^,]*;)?\s*dur=([0-9.]+)", re.I)


def new_trace_id() -> str:
    return uuid.uuid4().hex


@dataclass
class OpResult:
    """One ops request to one replica (the last attempt's timings; total_ms spans every attempt)."""
    kind: str
    replica: str
    trace_id: str
    ok: bool = False
    status: int | None = None
    error: str = ""
    wall_ms: float | None = None
    rpc_ms: float | None = None
    queue_ms: float | None = None
    rpc_source: str = ""  # "server-timing" | "ttfb" | ""
    connect_ms: float | None = None  # part of queue_ms spent opening the TCP connection
    send_ms: float | None = None  # call -> request headers written: the client-side part of queue_ms
    total_ms: float | None = None
    attempts: int = 0
    timed_out: bool = False
    body: Any = None
    started_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


class _Timing:
    __slots__ = ("t_sent", "t_conn_start", "t_conn_end")

    def __init__(self):
        self.t_sent = self.t_conn_start = self.t_conn_end = None


async def _on_headers_sent(session, ctx, params):
    ctx.trace_request_ctx.t_sent = time.perf_counter()


async def _on_conn_start(session, ctx, params):
    ctx.trace_request_ctx.t_conn_start = time.perf_counter()


async def _on_conn_end(session, ctx, params):
    ctx.trace_request_ctx.t_conn_end = time.perf_counter()


def parse_server_timing(value: str | None) -> float | None:
    if not value:
        return None
    m = _SERVER_TIMING.search(value)
    return float(m.group(1)) if m else None


def _transport_error(exc: BaseException) -> str:
    """The product's words for a failed request, with what the server said (a banner) as operators' detail."""
    _fc, reason, detail, _retry = outbound.describe(exc)
    return with_detail(reason, detail)


class OpsClient:
    """Use as `async with OpsClient(...) as c: await c.call(url, "POST", "/pause", kind="pause")`."""

    def __init__(self, *, api_key: str | None = None, connect_timeout_s: float = 5.0,
                 timeouts: dict[str, float] | None = None, max_retries: int = 2, backoff_s: float = 0.2,
                 limit: int = 64):
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.timeouts = {**DEFAULT_TIMEOUTS_S, **(timeouts or {})}
        self.max_retries = max(0, min(int(max_retries), 10))
        self.backoff_s = backoff_s
        self.limit = limit
        self._session: outbound.GatedSession | None = None

    async def __aenter__(self) -> "OpsClient":
        tc = aiohttp.TraceConfig()  # its default context carries our _Timing as trace_request_ctx
        tc.on_request_headers_sent.append(_on_headers_sent)
        tc.on_connection_create_start.append(_on_conn_start)
        tc.on_connection_create_end.append(_on_conn_end)
        self._session = outbound.gated_session(force_close=True, limit=self.limit, ttl_dns_cache=300,
                                               trace_configs=[tc], max_bytes=MAX_BODY_BYTES)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def timeout_for(self, kind: str) -> float:
        return float(self.timeouts.get(kind, DEFAULT_TIMEOUT_S))

    async def call(self, base_url: str, method: str, path: str, *, kind: str, params: dict | None = None,
                   json_body: Any = None, trace_id: str | None = None, timeout_s: float | None = None) -> OpResult:
        """One operation on one replica; never raises on HTTP or network errors."""
        assert self._session is not None, "use OpsClient as an async context manager"
        base = base_url.rstrip("/")
        res = OpResult(kind=kind, replica=base, trace_id=trace_id or new_trace_id())
        timeout_s = timeout_s if timeout_s is not None else self.timeout_for(kind)
        headers = {TRACE_HEADER: res.trace_id, "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        t_first = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            res.attempts = attempt + 1
            retry = await self._attempt(res, method, base + path, params, json_body, headers, timeout_s)
            if not retry or attempt == self.max_retries:
                break
            await asyncio.sleep(self.backoff_s * (2 ** attempt))
        res.total_ms = round((time.perf_counter() - t_first) * 1000, 3)
        return res

    async def _attempt(self, res: OpResult, method, url, params, json_body, headers, timeout_s) -> bool:
        """Fill res from one attempt; True when it is worth retrying (5xx, transport error)."""
        timing = _Timing()
        t0 = time.perf_counter()
        res.rpc_ms = res.queue_ms = res.connect_ms = res.send_ms = None
        res.rpc_source = ""
        res.timed_out = False
        tmo = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, self.connect_timeout_s))
        try:
            # No redirects: a 3xx is the server's answer (following one would send an ops call, and read
            # back a page, wherever the server points: issue 12's SSRF). The body is read up to a cap.
            async with self._session.request(method, url, params=params, json=json_body, headers=headers,
                                             timeout=tmo, trace_request_ctx=timing) as resp:
                t_headers = time.perf_counter()
                try:
                    raw = await resp.read()  # capped at MAX_BODY_BYTES by the gate
                except outbound.ResponseTooLarge:
                    res.status, res.ok, res.body = resp.status, False, None
                    res.wall_ms = round((time.perf_counter() - t0) * 1000, 3)
                    res.error = f"HTTP {resp.status}: answer over {MAX_BODY_BYTES} bytes (not read)"
                    return False
                t_end = time.perf_counter()
                res.status = resp.status
                server_ms = parse_server_timing(resp.headers.get("Server-Timing"))
                if server_ms is not None:
                    res.rpc_ms, res.rpc_source = server_ms, "server-timing"
                elif timing.t_sent is not None:
                    res.rpc_ms, res.rpc_source = (t_headers - timing.t_sent) * 1000, "ttfb"
                res.wall_ms = (t_end - t0) * 1000
                if timing.t_sent is not None:
                    res.send_ms = round((timing.t_sent - t0) * 1000, 3)
                if timing.t_conn_start is not None and timing.t_conn_end is not None:
                    res.connect_ms = round((timing.t_conn_end - timing.t_conn_start) * 1000, 3)
                if res.rpc_ms is not None:
                    res.rpc_ms = round(min(res.rpc_ms, res.wall_ms), 3)
                    res.queue_ms = round(max(0.0, res.wall_ms - res.rpc_ms), 3)
                res.wall_ms = round(res.wall_ms, 3)
                text = raw.decode("utf-8", "replace")
                try:
                    res.body = json.loads(text) if text.strip() else None
                except ValueError:
                    res.body = text[:2000]
                res.ok = 200 <= resp.status < 300
                if not res.ok:  # the server's message is for operators (workers.disclosure)
                    res.error = with_detail(f"HTTP {resp.status}", _error_message(res.body))[:500]
                return resp.status >= 500
        except asyncio.TimeoutError:
            res.ok, res.timed_out = False, True
            res.wall_ms = round((time.perf_counter() - t0) * 1000, 3)
            res.error = f"no answer within {timeout_s:g} s"
            return False
        except outbound.OutboundRefused as exc:  # not an allowed address: nothing sent, nothing to retry
            res.ok = False
            res.wall_ms = round((time.perf_counter() - t0) * 1000, 3)
            res.error = f"not called: {exc.reason}"
            return False
        except outbound.ResponseTooLarge:
            res.ok = False
            res.wall_ms = round((time.perf_counter() - t0) * 1000, 3)
            res.error = f"answer over {MAX_BODY_BYTES} bytes (not read)"
            return False
        except aiohttp.ClientError as exc:
            res.ok = False
            res.wall_ms = round((time.perf_counter() - t0) * 1000, 3)
            res.error = _transport_error(exc)
            return True


def _error_message(body) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
        return json.dumps(body)[:300]
    return str(body or "")[:300]
