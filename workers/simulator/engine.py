"""The simulated engine: capacity, FIFO waiting queue, KV cache, latency, pause/sleep/weight updates.

One `Engine` per app, all on one event loop (no locks needed). A request:
  arrival -> waits in the FIFO queue while running == max_num_seqs, the KV cache cannot hold its
  prompt, or the engine is paused/sleeping -> admitted (running) -> time to first token -> one token
  every inter-token latency -> finished (stop, or abort when /pause?mode=abort hits it).
Delays are multiplied by (1 + load_factor * running / max_num_seqs) and a jitter factor.
Token times are planned on an absolute timeline; tokens that fall due within 1 ms of each other are
emitted together (one write), so small inter-token latencies do not mean one sleep per token.
With ttft_ms = itl_ms = 0 a request completes without suspending at all (the fast path).
"""
from __future__ import annotations

import asyncio
import random
from collections import deque

from .config import SimConfig
from .metrics import Metrics

PREFIX_BLOCK = 16  # prefix-cache block size, tokens
_FLUSH_S = 0.001  # tokens due within this much time are emitted together


class QueueFull(Exception):
    pass


class Request:
    __slots__ = ("prompt_tokens", "prompt_blocks", "cached_tokens", "n_out", "generated", "arrival",
                 "admitted", "first_token", "finished", "kv", "aborted", "finish_reason", "wake",
                 "preempted", "weight_version")

    def __init__(self, prompt_tokens: int, n_out: int, prompt_blocks=()):
        self.prompt_tokens = prompt_tokens
        self.prompt_blocks = prompt_blocks  # chained hashes of full 16-token prompt blocks
        self.cached_tokens = 0
        self.n_out = n_out
        self.generated = 0
        self.arrival = 0.0
        self.admitted = 0.0
        self.first_token = 0.0
        self.finished = 0.0
        self.kv = 0
        self.aborted = False
        self.finish_reason = "stop"
        self.wake: asyncio.Future | None = None
        self.preempted = 0
        self.weight_version = 0


class Engine:
    def __init__(self, config: SimConfig, metrics: Metrics, seed: int):
        self.cfg = config
        self.metrics = metrics
        self.jrng = random.Random(seed ^ 0x5EED)
        self.running = 0
        self.active: set[Request] = set()
        self.queue: deque[tuple[Request, asyncio.Future]] = deque()
        self.kv_tokens = 0
        self.paused = False
        self.pause_mode = ""
        self.sleep_level = 0
        self.updating = 0
        self.weight_version = 0
        self.weights_lock = asyncio.Lock()
        self.gated: set[Request] = set()  # requests waiting for the generation gate
        self.idle_waiters: list[asyncio.Future] = []
        self.prefix_cache: dict[int, None] = {}

    # ---- state ---------------------------------------------------------------------------------
    @property
    def admitting(self) -> bool:
        return not self.paused and not self.sleep_level

    @property
    def generating(self) -> bool:
        return not (self.paused and self.pause_mode == "keep") and not self.sleep_level and not self.updating

    @property
    def instant(self) -> bool:
        c = self.cfg
        return c.ttft_ms == 0 and c.itl_ms == 0 and c.prefill_ms_per_1k == 0

    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens / self.cfg.kv_cache_tokens)

    def load_mult(self) -> float:
        lf = self.cfg.load_factor
        return 1.0 + lf * self.running / self.cfg.max_num_seqs if lf else 1.0

    def jit(self) -> float:
        j = self.cfg.jitter
        return 1.0 + j * (2.0 * self.jrng.random() - 1.0) if j else 1.0

    # ---- admission -----------------------------------------------------------------------------
    def _fits(self, req: Request) -> bool:
        return self.running < self.cfg.max_num_seqs and (
            self.running == 0 or self.kv_tokens + req.prompt_tokens + req.generated <= self.cfg.kv_cache_tokens)

    def _start(self, req: Request, now: float) -> None:
        self.running += 1
        self.active.add(req)
        req.admitted = now
        req.kv = req.prompt_tokens + req.generated
        self.kv_tokens += req.kv
        if not req.preempted:
            self.metrics.queue.observe(now - req.arrival)
            self._prefix_lookup(req)

    def _prefix_lookup(self, req: Request) -> None:
        m = self.metrics
        m.prefix_queries += req.prompt_tokens
        hit = 0
        cache = self.prefix_cache
        for h in req.prompt_blocks:
            if h in cache:
                hit += PREFIX_BLOCK
            else:
                break
        hit = min(hit, max(0, req.prompt_tokens - 1))
        req.cached_tokens = hit
        m.prefix_hits += hit
        if len(cache) > self.cfg.kv_cache_tokens // PREFIX_BLOCK:
            cache.clear()
        for h in req.prompt_blocks:
            cache[h] = None

    def _release(self, req: Request) -> None:
        if req in self.active:
            self.active.discard(req)
            self.running -= 1
            self.kv_tokens -= req.kv
            req.kv = 0
        self._pump()
        if self.running == 0 and self.idle_waiters:
            for f in self.idle_waiters:
                if not f.done():
                    f.set_result(None)
            self.idle_waiters.clear()

    def _pump(self) -> None:
        if not self.admitting:
            return
        q = self.queue
        now = None
        while q:
            req, fut = q[0]
            if fut.done():  # cancelled by a disconnected client
                q.popleft()
                continue
            if not self._fits(req):
                break
            q.popleft()
            if now is None:
                now = asyncio.get_running_loop().time()
            self._start(req, now)
            fut.set_result(True)

    async def _admit(self, req: Request, front: bool = False) -> bool:
        """Wait for a slot; False when aborted while waiting."""
        loop = asyncio.get_running_loop()
        if not front:
            req.arrival = loop.time()
        if not self.queue and self.admitting and self._fits(req):
            self._start(req, req.arrival if not front else loop.time())
            return True
        if not front and len(self.queue) >= self.cfg.max_queue:
            raise QueueFull()
        fut = loop.create_future()
        item = (req, fut)
        if front:
            self.queue.appendleft(item)
        else:
            self.queue.append(item)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self._release(req)
            else:
                fut.cancel()
                try:
                    self.queue.remove(item)
                except ValueError:
                    pass
            raise

    # ---- generation ----------------------------------------------------------------------------
    async def _sleep_until(self, req: Request, when: float) -> None:
        loop = asyncio.get_running_loop()
        if when - loop.time() <= 0 or req.aborted:
            return
        fut = loop.create_future()
        req.wake = fut
        h = loop.call_at(when, _wake, fut)
        try:
            await fut
        finally:
            h.cancel()
            req.wake = None

    async def _gate(self, req: Request) -> float:
        """Wait while token generation is held (pause keep / sleep / weight update); seconds waited."""
        if self.generating or req.aborted:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.gated.add(req)
        try:
            while not self.generating and not req.aborted:
                fut = loop.create_future()
                req.wake = fut
                await fut
        finally:
            self.gated.discard(req)
            req.wake = None
        return loop.time() - t0

    def open_gate(self) -> None:
        if self.generating:
            for r in list(self.gated):
                _wake(r.wake)
        self._pump()

    async def run(self, req: Request, emit=None) -> Request:
        """Admit, generate req.n_out tokens, finish. `emit(a, b)` (a coroutine function) is awaited
        with the index range of tokens that became available, in order, for streaming."""
        m = self.metrics
        if self.instant and not self.queue and self.admitting and self.generating and self._fits(req):
            # Fast path: zero latency, capacity free, nothing paused: no suspension at all.
            now = asyncio.get_running_loop().time()
            req.arrival = now
            self._start(req, now)
            req.first_token = req.finished = now
            req.generated = req.n_out
            req.weight_version = self.weight_version
            self.running -= 1
            self.active.discard(req)
            self.kv_tokens -= req.kv
            req.kv = 0
            if self.queue:
                self._pump()
            m.ttft.observe(0.0)
            if req.n_out > 1:
                m.itl.observe(0.0, req.n_out - 1)
            self._finish_metrics(req)
            if emit is not None:
                await emit(0, req.n_out)
            return req
        if not await self._admit(req):
            req.finish_reason = "abort"
            req.finished = req.first_token = asyncio.get_running_loop().time()
            self._finish_metrics(req)
            return req
        try:
            await self._generate(req, emit)
        except asyncio.CancelledError:  # the client went away: vLLM aborts the request
            req.finish_reason = "abort"
            req.finished = asyncio.get_running_loop().time()
            if not req.first_token:
                req.first_token = req.finished
            self._finish_metrics(req)
            raise
        finally:
            self._release(req)
        self._finish_metrics(req)
        return req

    async def _generate(self, req: Request, emit) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        m = self.metrics
        sent = 0
        while True:  # one pass per (re)admission; a preempted request recomputes its prefill
            uncached = req.prompt_tokens + req.generated - (req.cached_tokens if not req.preempted else 0)
            prefill = (cfg.ttft_ms + cfg.prefill_ms_per_1k * uncached / 1000.0) / 1000.0
            t = loop.time() + prefill * self.load_mult() * self.jit()
            await self._sleep_until(req, t)
            t += await self._gate(req)
            if req.aborted:
                break
            if req.generated == 0:
                req.first_token = loop.time()
                m.ttft.observe(req.first_token - req.arrival)
                req.generated = 1
                self.kv_tokens += 1
                req.kv += 1
            preempt = False
            while req.generated < req.n_out:
                gap = cfg.itl_ms / 1000.0 * self.load_mult() * self.jit()
                t += gap
                now = loop.time()
                if t - now > _FLUSH_S:
                    if emit is not None and sent < req.generated:
                        await emit(sent, req.generated)
                        sent = req.generated
                    await self._sleep_until(req, t)
                    waited = await self._gate(req)
                    t += waited
                    gap += waited
                    if req.aborted:
                        break
                m.itl.observe(gap)
                req.generated += 1
                self.kv_tokens += 1
                req.kv += 1
                if self.kv_tokens > cfg.kv_cache_tokens and self.running > 1:
                    preempt = True
                    break
            if not preempt or req.aborted:
                break
            # KV cache overflow: give the slot and the cache back, wait at the front of the queue.
            m.preemptions += 1
            req.preempted += 1
            if emit is not None and sent < req.generated:
                await emit(sent, req.generated)
                sent = req.generated
            self._release(req)
            if not await self._admit(req, front=True):
                break
        if req.aborted:
            req.finish_reason = "abort"
        req.finished = loop.time()
        req.weight_version = self.weight_version
        if emit is not None and sent < req.generated:
            await emit(sent, req.generated)

    def _finish_metrics(self, req: Request) -> None:
        m = self.metrics
        m.prompt_tokens += req.prompt_tokens
        m.generation_tokens += req.generated
        m.success[req.finish_reason] = m.success.get(req.finish_reason, 0) + 1
        m.e2e.observe(req.finished - req.arrival)
        if req.admitted:
            m.prefill.observe(max(0.0, req.first_token - req.admitted))
            m.decode.observe(max(0.0, req.finished - req.first_token))
        m.req_prompt.observe(req.prompt_tokens)
        m.req_gen.observe(req.generated)

    # ---- admin ---------------------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        self.paused = True
        self.pause_mode = mode
        if mode == "abort":
            for r in list(self.active):
                r.aborted = True
                _wake(r.wake)
            while self.queue:
                req, fut = self.queue.popleft()
                req.aborted = True
                if not fut.done():
                    fut.set_result(False)
        elif mode == "wait" and self.running:
            fut = asyncio.get_running_loop().create_future()
            self.idle_waiters.append(fut)
            await fut

    def resume(self) -> None:
        self.paused = False
        self.pause_mode = ""
        self.open_gate()

    def sleep(self, level: int) -> None:
        self.sleep_level = level
        self.prefix_cache.clear()

    def wake_up(self) -> None:
        self.sleep_level = 0
        self.open_gate()

    async def update_weights(self, duration_s: float) -> int:
        async with self.weights_lock:
            self.updating += 1
            try:
                await asyncio.sleep(duration_s)
                self.weight_version += 1
                self.prefix_cache.clear()  # new weights: cached KV is stale
            finally:
                self.updating -= 1
                self.open_gate()
        return self.weight_version

    def reconfigured(self) -> None:
        """Capacity knobs may have grown: admit what now fits."""
        self._pump()


def _wake(fut) -> None:
    if fut is not None and not fut.done():
        fut.set_result(True)
