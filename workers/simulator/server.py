"""The simulator's HTTP surface: `create_app(config) -> aiohttp.web.Application`.

OpenAI-compatible (behind --api-key when set): /v1/chat/completions, /v1/completions, /v1/responses,
/v1/models. Utility: /health, /ping, /version, /load, /metrics, /tokenize. RL/admin:
/pause?mode=abort|wait|keep, /resume, /is_paused, /update_weights, /weight_version,
/reset_prefix_cache, /sleep?level=, /wake_up, /is_sleeping, GET|POST /admin/config.

Weight version: every OpenAI response carries the header `X-Weight-Version` (for streams: the version
when the stream started) and a top-level body field `"weight_version"` (the version when generation
finished; in streams it is on the last chunk(s)); Responses API objects also carry it as
`metadata.weight_version` (a string, as OpenAI metadata values are). A request's `X-Trace-Id` header
is echoed back.

Admin routes answer with `Server-Timing: rpc;dur=<ms>` (the time the server spent on the request, from
its handler starting to the response being ready), so a client can split its own wall time into server
time and client-side queueing. The knob `admin_faults` makes an admin route fail on demand.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import random
import time

from aiohttp import web

from . import text as T
from .config import ConfigError, SimConfig
from .engine import Engine, QueueFull, Request
from .faults import FAULT_HEADER, RETRY_AFTER_HEADER, FaultPicker, RateLimiter, retry_after_header
from .formats import FORMATS
from .metrics import Metrics

SIM_VERSION = "0.1.0-sim"
STALL_MAX_S = 3600.0
_dumps = json.dumps


class Sim:
    """Per-app state: config (replaced atomically by /admin/config), engine, metrics, counters."""

    def __init__(self, config: SimConfig):
        self.cfg = config
        self.seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**62)
        self.metrics = Metrics(config.model)
        self.engine = Engine(config, self.metrics, self.seed)
        self.faults = FaultPicker(self.seed)
        self.limiter = RateLimiter()
        self.occurrences: dict[bytes, int] = {}
        self.ids = itertools.count(1)
        self.id_prefix = "%08x" % random.Random(self.seed).getrandbits(32)
        self.started = time.time()
        self.traceparents: collections.deque[str] = collections.deque(maxlen=10000)  # GET /admin/traceparents
        self.metadata_traceparents: collections.deque[str] = collections.deque(maxlen=10000)  # metadata.traceparent

    def set_config(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.engine.cfg = cfg
        self.metrics.model_name = cfg.model
        self.engine.reconfigured()

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{self.id_prefix}{next(self.ids):08x}"

    def rng_for(self, key: str, body: dict) -> random.Random:
        """Same seed + same request sequence -> same outputs; repeats of one prompt still vary
        (occurrence count), unless temperature == 0 (greedy) or the request sets its own seed."""
        import hashlib

        digest = hashlib.blake2b(key.encode(), digest_size=12).digest()
        if body.get("seed") is not None:
            occ = f"s{body.get('seed')}"
        elif body.get("temperature") == 0:
            occ = "greedy"
        else:
            n = self.occurrences.get(digest, 0)
            if len(self.occurrences) > 2_000_000:
                self.occurrences.clear()
            self.occurrences[digest] = n + 1
            occ = n
        return T.request_rng(self.seed, digest.hex(), occ)


SIM = web.AppKey("sim", Sim)


# ---- helpers -------------------------------------------------------------------------------------
def _json(obj, status: int = 200, headers=None) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json", headers=headers)


def error_response(status: int, message: str, type_: str, headers=None) -> web.Response:
    """vLLM's error body (new nested shape, plus the older flat keys for old clients)."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": status},
            "object": "error", "message": message, "type": type_, "code": status}
    return _json(body, status, headers)


def _context_error(cfg: SimConfig, n_prompt: int, n_out: int) -> web.Response:
    total = n_prompt + n_out
    return error_response(
        400,
        f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
        f"{total} tokens ({n_prompt} in the messages, {n_out} in the completion). Please reduce the "
        f"length of the messages or completion.",
        "BadRequestError")


def _prompt_blocks(tokens: list[str]) -> tuple:
    n = len(tokens) // 16
    if not n:
        return ()
    out = []
    h = 0
    for i in range(n):
        h = hash((h, tuple(tokens[i * 16:(i + 1) * 16])))
        out.append(h)
    return tuple(out)


class _Bad(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.type_ = type_


def _int_param(body: dict, *names: str):
    for name in names:
        v = body.get(name)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _Bad(f"{name} must be an integer >= 1, got {v!r}")
            return v
    return None


def _parse(kind: str, body: dict):
    """(prompt text or None, prompt token count, prompt tokens, math question, max tokens)."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _Bad("messages must be a non-empty list")
        try:
            rendered = T.render_chat(messages)
        except ValueError as e:
            raise _Bad(str(e)) from None
        question = T.last_user_text(messages)
        max_t = _int_param(body, "max_completion_tokens", "max_tokens")
    elif kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            toks = [str(t) for t in prompt]
            return " ".join(toks), len(toks), toks, None, _int_param(body, "max_tokens")
        if not isinstance(prompt, str):
            raise _Bad("prompt must be a string, a list with one string, or a list of token ids")
        rendered = question = prompt
        max_t = _int_param(body, "max_tokens")
    else:  # responses
        inp = body.get("input")
        instructions = body.get("instructions")
        if isinstance(inp, str):
            messages = [{"role": "user", "content": inp}]
        elif isinstance(inp, list) and inp:
            messages = []
            for item in inp:
                if not isinstance(item, dict):
                    raise _Bad("input items must be objects")
                if "role" in item:
                    messages.append({"role": item["role"], "content": item.get("content")})
                elif item.get("type") == "function_call_output":
                    messages.append({"role": "tool", "content": item.get("output")})
        else:
            raise _Bad("input must be a string or a non-empty list of items")
        if isinstance(instructions, str) and instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        rendered = T.render_chat(messages)
        question = T.last_user_text(messages)
        max_t = _int_param(body, "max_output_tokens")
    toks = T.tokenize(rendered)
    return rendered, len(toks), toks, question, max_t


# ---- OpenAI routes ---------------------------------------------------------------------------------
async def _openai(request: web.Request, kind: str):
    sim: Sim = request.app[SIM]
    cfg = sim.cfg
    if cfg.api_key and request.headers.get("Authorization") != "Bearer " + cfg.api_key:
        return _json({"error": "Unauthorized"}, 401)
    if cfg.unhealthy:
        return error_response(503, "The engine is dead (simulated: unhealthy=true).", "ServiceUnavailableError")
    try:
        body = json.loads(await request.read())
        if not isinstance(body, dict):
            raise ValueError
    except ValueError:
        return error_response(400, "The request body must be a JSON object.", "BadRequestError")
    model = body.get("model")
    if model is not None and model != cfg.model:
        return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
    try:
        rendered, n_prompt, ptoks, question, max_t = _parse(kind, body)
        if body.get("n") not in (None, 1):
            raise _Bad("the simulator supports n=1 only")
        fault = sim.faults.pick(cfg.fault_rates, request.headers.get(FAULT_HEADER))
    except _Bad as e:
        return error_response(e.status, str(e), e.type_)
    except ValueError as e:
        return error_response(400, str(e), "BadRequestError")

    hdrs = {"X-Weight-Version": str(sim.engine.weight_version)}
    trace = request.headers.get("X-Trace-Id")
    if trace:
        hdrs["X-Trace-Id"] = trace
    parent = request.headers.get("traceparent")
    if parent:  # W3C trace context: kept (the last 10,000) for tests to find, echoed as a real server's proxy might
        sim.traceparents.append(parent[:200])
        hdrs["traceparent"] = parent[:200]
    md = body.get("metadata")
    if isinstance(md, dict) and isinstance(md.get("traceparent"), str):  # carried in the body by a NeMo Gym agent
        sim.metadata_traceparents.append(md["traceparent"][:200])

    room = cfg.max_model_len - n_prompt
    if max_t is not None and max_t > room or room < 1:
        return _context_error(cfg, n_prompt, max_t or 1)
    if fault is not None:
        resp = await _inject(request, sim, fault, hdrs, n_prompt, max_t, bool(body.get("stream")))
        if resp is not None:
            return resp

    rng = sim.rng_for(kind + "\x00" + rendered, body)
    n_out = max_t if max_t is not None else min(room, rng.randint(cfg.output_len_min, cfg.output_len_max))
    call = T.tool_call(body) if kind == "chat" and cfg.tool_calls and not body.get("stream") else None
    if call is not None:  # the model calls a tool: its output tokens are the call's arguments
        call_tokens = T.tokenize(call[1])
        if len(call_tokens) > min(n_out if max_t is not None else room, room):
            call = None
        else:
            n_out = len(call_tokens)
    if cfg.rpm_limit or cfg.tpm_limit:
        wait = sim.limiter.check(asyncio.get_running_loop().time(), cfg.rpm_limit, cfg.tpm_limit, n_prompt + n_out)
        if wait is not None:
            return error_response(429, "Rate limit exceeded (simulated hosted-API RPM/TPM limit).",
                                  "RateLimitError", {"Retry-After": retry_after_header(wait), **hdrs})
    tokens, _ = T.generate(rng, n_out, question, cfg.math_accuracy)
    req = Request(n_prompt, n_out, _prompt_blocks(ptoks))
    stream = bool(body.get("stream"))
    fmt = FORMATS[kind](sim, body, cfg.model, n_prompt, call_tokens if call is not None else tokens)
    if call is not None:
        fmt.tool_call = (sim.next_id("call"), *call)
    try:
        if not stream:
            await sim.engine.run(req)
            return _json(fmt.full(req), headers=hdrs)
        if sim.engine.instant and fault != "drop":
            await sim.engine.run(req)
            return web.Response(body="".join(fmt.stream_all(req)).encode(), content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", **hdrs})
        return await _stream(request, sim, req, fmt, hdrs, drop=fault == "drop")
    except QueueFull:
        return error_response(429, f"The waiting queue is full ({cfg.max_queue} requests).", "RateLimitError",
                              {"Retry-After": retry_after_header(cfg.retry_after_s), **hdrs})


async def _inject(request, sim: Sim, fault: str, hdrs, n_prompt: int, max_t, stream: bool):
    cfg = sim.cfg
    if fault == "429":
        ra = request.headers.get(RETRY_AFTER_HEADER)
        try:
            ra_s = float(ra) if ra is not None else cfg.retry_after_s
        except ValueError:
            ra_s = cfg.retry_after_s
        return error_response(429, "Too many requests (simulated fault).", "RateLimitError",
                              {"Retry-After": retry_after_header(ra_s), **hdrs})
    if fault == "500":
        return error_response(500, "Internal server error (simulated fault).", "InternalServerError", hdrs)
    if fault == "503":
        return error_response(503, "Service unavailable (simulated fault).", "ServiceUnavailableError",
                              {"Retry-After": retry_after_header(cfg.retry_after_s), **hdrs})
    if fault == "400":
        return _context_error(cfg, n_prompt, cfg.max_model_len - n_prompt + max(1, max_t or 1) + 1)
    if fault == "stall":
        await asyncio.sleep(STALL_MAX_S)  # cancelled when the client gives up (handler_cancellation)
        return error_response(504, "Stalled (simulated fault).", "TimeoutError", hdrs)
    if fault == "drop" and not stream:
        _drop(request)
        raise asyncio.CancelledError()  # nothing more to send: the connection is gone
    return None  # drop mid-stream: handled while streaming


def _drop(request) -> None:
    tr = request.transport
    if tr is not None:
        tr.abort() if hasattr(tr, "abort") else tr.close()


async def _stream(request, sim: Sim, req: Request, fmt, hdrs, drop: bool):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **hdrs})
    state = {"started": False}
    drop_at = max(1, req.n_out // 2) if drop else None

    async def emit(a: int, b: int):
        if not state["started"]:
            state["started"] = True
            await resp.prepare(request)
            parts = [fmt.stream_head()]
        else:
            parts = []
        if drop_at is not None and b >= drop_at:
            parts.extend(fmt.stream_tokens(a, drop_at))
            await resp.write("".join(parts).encode())
            _drop(request)
            raise asyncio.CancelledError()
        parts.extend(fmt.stream_tokens(a, b))
        await resp.write("".join(parts).encode())

    await sim.engine.run(req, emit)
    tail = [] if state["started"] else [fmt.stream_head()]
    if not state["started"]:
        await resp.prepare(request)
    tail.extend(fmt.stream_tail(req))
    await resp.write("".join(tail).encode())
    await resp.write_eof()
    return resp


# ---- response formats ------------------------------------------------------------------------------


async def chat_completions(request):
    return await _openai(request, "chat")


async def completions(request):
    return await _openai(request, "completions")


async def responses(request):
    return await _openai(request, "responses")


async def models(request):
    sim: Sim = request.app[SIM]
    cfg = sim.cfg
    if cfg.api_key and request.headers.get("Authorization") != "Bearer " + cfg.api_key:
        return _json({"error": "Unauthorized"}, 401)
    return _json({"object": "list", "data": [{"id": cfg.model, "object": "model", "created": int(sim.started),
                                              "owned_by": "vllm", "root": cfg.model, "parent": None,
                                              "max_model_len": cfg.max_model_len, "permission": []}]})


# ---- utility routes --------------------------------------------------------------------------------
async def health(request):
    sim: Sim = request.app[SIM]
    if sim.cfg.unhealthy:
        return web.Response(status=503)
    return web.Response(status=200)


async def ping(request):
    return await health(request)


async def version(request):
    return _json({"version": SIM_VERSION, "simulator": True})


async def load(request):
    e = request.app[SIM].engine
    return _json({"server_load": e.running + len(e.queue)})


async def metrics(request):
    sim: Sim = request.app[SIM]
    e = sim.engine
    cfg = sim.cfg
    waiting = len(e.queue)
    body = sim.metrics.render(
        running=e.running, waiting=waiting, waiting_capacity=0 if not e.admitting else waiting,
        kv_usage=e.kv_usage(), sleeping=e.sleep_level,
        cache_info={"block_size": "16", "num_gpu_blocks": str(cfg.kv_cache_tokens // 16),
                    "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
                    # as vLLM 0.32 labels them: the KV cache's size and how many max_model_len requests it holds
                    # (max_num_seqs is not among vLLM's labels, so not among these either)
                    "kv_cache_size_tokens": str(cfg.kv_cache_tokens),
                    "kv_cache_max_concurrency": f"{cfg.kv_cache_tokens / max(1, cfg.max_model_len):.1f}"})
    return web.Response(text=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def tokenize(request):
    sim: Sim = request.app[SIM]
    try:
        body = json.loads(await request.read())
        if not isinstance(body, dict):
            raise ValueError
        if "messages" in body:
            rendered = T.render_chat(body["messages"])
        elif isinstance(body.get("prompt"), str):
            rendered = body["prompt"]
        else:
            raise ValueError
    except (ValueError, TypeError, AttributeError):
        return error_response(400, "tokenize takes a JSON object with `prompt` (string) or `messages` (list).",
                              "BadRequestError")
    toks = T.tokenize(rendered)
    return _json({"count": len(toks), "max_model_len": sim.cfg.max_model_len, "tokens": [T.token_id(t) for t in toks],
                  "token_strs": toks if body.get("return_token_strs") else None})


# ---- RL / admin routes -----------------------------------------------------------------------------
ADMIN_PATHS = {"/pause": "pause", "/resume": "resume", "/update_weights": "update_weights",
               "/reset_prefix_cache": "reset_prefix_cache", "/sleep": "sleep", "/wake_up": "wake_up",
               "/health": "health", "/is_paused": None, "/weight_version": None, "/is_sleeping": None}


@web.middleware
async def hang_while_set(request, handler):
    """The `hang` knob: hold every request but /admin/config without answering while it is set."""
    sim = request.app[SIM]
    if sim.cfg.hang and request.path != "/admin/config":
        deadline = time.monotonic() + STALL_MAX_S
        while sim.cfg.hang and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    return await handler(request)


@web.middleware
async def admin_timing(request, handler):
    """Server-Timing on admin routes (rpc_ms for the client), the echoed trace id, injected admin faults."""
    if request.path not in ADMIN_PATHS:
        return await handler(request)
    t0 = time.perf_counter()
    route = ADMIN_PATHS[request.path]
    fault = request.app[SIM].cfg.admin_faults.get(route) if route else None
    if fault == "stall":
        await asyncio.sleep(STALL_MAX_S)
    if fault in ("500", "503", "400"):
        resp = error_response(int(fault), f"{route} failed (simulated admin fault {fault}).",
                              "BadRequestError" if fault == "400" else "InternalServerError")
    else:
        resp = await handler(request)
    resp.headers["Server-Timing"] = "rpc;dur=%.3f" % ((time.perf_counter() - t0) * 1000)
    trace = request.headers.get("X-Trace-Id")
    if trace:
        resp.headers["X-Trace-Id"] = trace
    return resp


async def pause(request):
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        return error_response(400, f"mode must be abort, wait or keep, got {mode!r}", "BadRequestError")
    sim: Sim = request.app[SIM]
    t0 = time.perf_counter()
    await sim.engine.pause(mode)
    return _json({"status": "paused", "mode": mode, "wait_ms": round((time.perf_counter() - t0) * 1000, 3)})


async def resume(request):
    request.app[SIM].engine.resume()
    return _json({"status": "resumed"})


async def is_paused(request):
    e = request.app[SIM].engine
    return _json({"is_paused": e.paused, "mode": e.pause_mode or None})


async def update_weights(request):
    sim: Sim = request.app[SIM]
    duration_ms = sim.cfg.update_weights_ms
    target = None
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise ValueError
        if "duration_ms" in request.query:
            body.setdefault("duration_ms", float(request.query["duration_ms"]))
        if body.get("duration_ms") is not None:
            duration_ms = float(body["duration_ms"])
            if duration_ms < 0 or duration_ms != duration_ms:
                raise ValueError
        target = body.get("weight_version")
        if target is not None and (not isinstance(target, int) or isinstance(target, bool)):
            raise ValueError
    except (ValueError, TypeError):
        return error_response(400, "update_weights takes an optional JSON object {duration_ms: number >= 0, "
                                   "weight_version: integer}", "BadRequestError")
    t0 = time.perf_counter()
    v = await sim.engine.update_weights(duration_ms / 1000.0)
    if target is not None:
        sim.engine.weight_version = v = target
    return _json({"status": "ok", "weight_version": v, "duration_ms": round((time.perf_counter() - t0) * 1000, 3)},
                 headers={"X-Weight-Version": str(v)})


async def weight_version(request):
    return _json({"weight_version": request.app[SIM].engine.weight_version})


async def reset_prefix_cache(request):
    request.app[SIM].engine.prefix_cache.clear()
    return _json({"status": "ok"})


async def sleep(request):
    try:
        level = int(request.query.get("level", "1"))
        if level not in (1, 2):
            raise ValueError
    except ValueError:
        return error_response(400, "level must be 1 or 2", "BadRequestError")
    request.app[SIM].engine.sleep(level)
    return _json({"status": "sleeping", "level": level})


async def wake_up(request):
    request.app[SIM].engine.wake_up()
    return _json({"status": "awake"})


async def is_sleeping(request):
    return _json({"is_sleeping": bool(request.app[SIM].engine.sleep_level)})


async def get_config(request):
    return _json(request.app[SIM].cfg.to_dict())


async def get_traceparents(request):
    """The W3C traceparent headers of the model requests received (the last 10,000), oldest first; and, apart,
    the `metadata.traceparent` values their bodies carried (how a rollout's trace crosses a NeMo Gym agent)."""
    sim = request.app[SIM]
    return _json({"traceparents": list(sim.traceparents), "metadata_traceparents": list(sim.metadata_traceparents)})


async def post_config(request):
    sim: Sim = request.app[SIM]
    try:
        changes = json.loads(await request.read() or b"{}")
    except ValueError:
        return error_response(400, "the body must be a JSON object of knobs", "BadRequestError")
    try:
        new = sim.cfg.updated(changes)
    except (ConfigError, TypeError) as e:
        return error_response(400, str(e), "BadRequestError")
    sim.set_config(new)
    return _json(new.to_dict())


# ---- app -------------------------------------------------------------------------------------------
def create_app(config: SimConfig | None = None) -> web.Application:
    config = (config or SimConfig()).validate()
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[hang_while_set, admin_timing])
    app[SIM] = Sim(config)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/responses", responses)
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/ping", ping)
    r.add_post("/ping", ping)
    r.add_get("/version", version)
    r.add_get("/load", load)
    r.add_get("/metrics", metrics)
    r.add_post("/tokenize", tokenize)
    r.add_post("/pause", pause)
    r.add_post("/resume", resume)
    r.add_get("/is_paused", is_paused)
    r.add_post("/update_weights", update_weights)
    r.add_get("/weight_version", weight_version)
    r.add_post("/reset_prefix_cache", reset_prefix_cache)
    r.add_post("/sleep", sleep)
    r.add_post("/wake_up", wake_up)
    r.add_get("/is_sleeping", is_sleeping)
    r.add_get("/admin/config", get_config)
    r.add_get("/admin/traceparents", get_traceparents)
    r.add_post("/admin/config", post_config)
    return app


async def serve(app: web.Application, host: str, port: int, ready_line: bool = True):
    """Run until cancelled; prints 'simulator listening on http://HOST:PORT' once bound."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if ready_line:
        print(f"simulator listening on http://{host}:{bound} (pid {os.getpid()})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
