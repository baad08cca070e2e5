"""How the engine (and the batch verification job) runs a verifier: by its kind, with a result cache.

* cpu     -> the engine's process pool (`pooled`, the engine's batcher), off the event loop
* io      -> a thread pool of `concurrency` threads (subprocesses, files: the code-execution sandbox)
* remote  -> `averify` on the event loop, at most `concurrency` calls in flight (the judge adds its own)
* loop    -> older verifiers that declare no kind and are not cpu_bound: called on the event loop

Cache: identical (verifier@fingerprint, options, fast, response text, the row fields the verifier declares)
are computed once. With a `shared_url` (Redis; `shared_cache.SharedVerifyCache`) the cache is shared by every
chunk and worker of a job (`cache="job"`, scope "job:<id>:...") or of every job (`cache="global"`), and by
later verification runs of the same job; identical work in flight on two workers is computed once. Without
one, `cache="job"` keeps one cache per executor (one chunk run) and `cache="global"` one bounded cache per
worker process. `cache="off"` disables it. Concurrent identical requests in one run wait for the first.
An executor keeps the LOCAL_MAX results it used last (identical rollouts of a task run close together), not
every result of its run: a chunk of 250,000 distinct rollouts kept ~0.7 KB each, growing the worker with the
chunk (and so with the job, whose chunk size grows with it).

The shared cache pays only where a verification costs more than the Redis round trips it saves (a sandboxed
program, an LLM judge: yes; math-verify at 0 % hits: no, it cost the engine 1.2-1.8x the CPU). So with
`shared_choice="measured"` (the default) a run measures, over its first SHARED_PROBE shared lookups, the mean
wait of a verification it computed and of a lookup, and the shared hit rate; when hit rate x compute < lookup
(a lookup makes the rollout wait longer than its hits save; stores go on in the background) it goes on with its
local cache only (`stats()` says which and why). `shared_choice="always"` keeps Redis whatever it costs. bench/bench_verify_cache.py measures both.
`shared_choice="alone"`: the caller knows this run is the only process verifying its scope (the drop-in's one engine
process, scope "job:..."), so a lookup could only find what this run put there itself, which its local cache
holds: Redis is never asked (the probe's round trips, and the client made on the event loop, would only end in
the local choice).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .base import VerifyResult, get_verifier

log = logging.getLogger(__name__)

CACHE_MODES = ("off", "job", "global")
SHARED_CHOICES = ("measured", "always", "alone")
SHARED_PROBE = 256  # shared lookups measured before the choice
SHARED_PROBE_COMPUTED = 16  # ... of which at least this many computed (else nearly all hit: keep the shared cache)
_GLOBAL_MAX = 200_000
LOCAL_MAX = 8192  # results one executor keeps, least recently used dropped first (work in flight: always shared)


class BoundedLru(OrderedDict):
    """At most `limit` entries, the least recently used dropped first (the executor's and the worker's caches)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = max(1, int(limit))

    def use(self, key):
        """The value for key (None if absent), marked as just used."""
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


_global = BoundedLru(_GLOBAL_MAX)
_global_lock = threading.Lock()


def _field(row: dict, path: str):
    obj = row
    for part in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def cache_key(name: str, options: dict, fast: bool, text: str, row: dict, fields) -> str:
    expected = {f: _field(row, f) for f in fields}
    if not fields:  # a verifier that declares no field: the whole input row counts
        expected = {k: v for k, v in row.items() if not k.startswith("_ng_")}
    blob = json.dumps([name, options, fast, text, expected], sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.blake2b(blob.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


class VerifyExecutor:
    def __init__(self, name: str, options: dict | None, *, fast: bool = False, cache: str = "job",
                 concurrency: int = 32, pooled: Callable | None = None, shared_url: str | None = None,
                 shared_scope: str = "", shared_ttl_s: int = 7 * 24 * 3600, shared_claim_s: float = 60.0,
                 shared_choice: str = "measured", local_max: int = LOCAL_MAX):
        self.verifier = get_verifier(name)  # ValueError for an unknown name
        self.name = name
        self.cache_name = f"{name}@{self.verifier.fingerprint()}"  # changed verifier code: other keys
        # the options were checked where the job was created; here (the worker) they are clamped again to the
        # operator's maxima of now, so options stored before a maximum was lowered cannot exceed it
        self.options = self.verifier.validate_options(self.verifier.clamp_options(options or {}))
        self.fast = fast
        self.kind = self.verifier.effective_kind
        if fast and self.verifier.has_fast and self.kind == "cpu":
            self.kind = "loop"  # a cheap heuristic: not worth the process hop
        if cache not in CACHE_MODES:
            raise ValueError(f"verify cache must be one of {', '.join(CACHE_MODES)}, not {cache!r}")
        self.cache_mode = cache
        self.fields = tuple(self.verifier.required(self.options))
        if self.kind == "remote":
            self.fields = self.fields + ("question", "responses_create_params.input")
        self.pooled = pooled
        self.concurrency = max(1, int(concurrency))
        if isinstance(self.options.get("concurrency"), int) and self.options["concurrency"] >= 1:
            self.concurrency = self.options["concurrency"]  # the verifier's own limit (a judge's endpoint)
        self.threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="verify-io") if self.kind == "io" else None
        self.sem = asyncio.Semaphore(self.concurrency) if self.kind in ("io", "remote") else None
        self.cache = BoundedLru(local_max)  # done: key -> VerifyResult, the most recently used last
        self._inflight: dict[str, asyncio.Future] = {}  # being computed: identical requests wait for it
        self.hits = self.lookups = 0
        if shared_choice not in SHARED_CHOICES:
            raise ValueError(f"shared cache choice must be one of {', '.join(SHARED_CHOICES)}, not {shared_choice!r}")
        self.shared_choice = shared_choice
        self.choice = ""  # "" until chosen; "shared" or "local: <the measured costs>"
        self.shared = None
        if cache != "off" and shared_url and shared_scope:
            if shared_choice == "alone":
                self.choice = "local: the only process verifying this job (nothing another could share)"
            else:
                from .shared_cache import SharedVerifyCache

                self.shared = SharedVerifyCache(shared_url, shared_scope, ttl_s=shared_ttl_s,
                                                claim_ttl_s=shared_claim_s)
        self.shared_error = ""
        self._dropped = []  # shared caches given up: closed at aclose, after the calls still using them
        # measured while the shared cache is on: (count, total seconds)
        self._lookup = [0, 0.0]
        self._computed = [0, 0.0]
        self._storing: set[asyncio.Future] = set()
        self._shared_found = 0
        self.waiting = self.running = 0  # for the diagnosis: the verification queue and busy slots

    @property
    def needs_pool(self) -> bool:
        return self.kind == "cpu"

    def stats(self) -> dict:
        out = {"verify_kind": self.kind, "verify_queue": self.waiting, "verify_busy": self.running,
               "verify_slots": self.concurrency if self.kind in ("io", "remote") else None,
               "verify_cache_hits": self.hits, "verify_cache_lookups": self.lookups}
        info = getattr(self.verifier, "runtime_info", None)
        if info is not None:  # the code verifier: which sandbox this worker's programs run in
            out.update({f"verify_{k}": v for k, v in info().items()})
        if self.cache_mode != "off":
            out["verify_cache_shared"] = self.shared is not None
            used = [c for c in (self.shared, *self._dropped) if c is not None]  # a given-up one counts too
            if used:
                out.update(verify_cache_shared_hits=sum(c.shared_hits for c in used),
                           verify_cache_computed=sum(c.computed for c in used))
            if self.shared_error:
                out["verify_cache_error"] = self.shared_error
            if self.choice:
                out["verify_cache_choice"] = self.choice
        return out

    def key(self, row: dict, text: str) -> str:
        return cache_key(self.cache_name, self.options, self.fast, text, row, self.fields)

    def shared_failed(self, exc: BaseException) -> None:
        """Redis failed: this run goes on with its local cache (verification never fails because of the cache)."""
        self.shared_error = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("shared verification cache unavailable (%s); using the local cache for this run", self.shared_error)
        shared, self.shared = self.shared, None
        if shared is not None:
            asyncio.ensure_future(shared.aclose())

    def _stored(self, store: asyncio.Future) -> None:
        self._storing.discard(store)
        if not store.cancelled() and store.exception() is not None:
            self.shared_failed(store.exception())

    def _choose(self) -> None:
        """After SHARED_PROBE shared lookups: keep the shared cache only if it shortens a verification's wait,
        i.e. the wait its hits save (hit rate x a computation) is longer than a lookup (stores are in the
        background). Wall times: a saturated verifier pool makes computations slow (hits relieve it); a busy
        event loop makes lookups slow (their CPU is the engine's)."""
        lookups, lookup_s = self._lookup
        computed, compute_s = self._computed
        if self.choice or self.shared_choice != "measured" or lookups < SHARED_PROBE:
            return
        hit_rate = self._shared_found / lookups
        if computed < SHARED_PROBE_COMPUTED:
            self.choice = f"shared: {hit_rate:.0%} of {lookups} lookups found"
            return
        compute_ms, lookup_ms = 1000 * compute_s / computed, 1000 * lookup_s / lookups
        saves = hit_rate * compute_ms
        figures = f"hits {hit_rate:.0%} x verify {compute_ms:.2f} ms = {saves:.2f} ms vs lookup {lookup_ms:.2f} ms"
        if saves >= lookup_ms:
            self.choice = f"shared: {figures}"
            return
        self.choice = f"local: {figures}"
        log.info("verification cache: local for this run (%s)", figures)
        self._dropped.append(self.shared)
        self.shared = None

    async def verify(self, row: dict, text: str) -> VerifyResult:
        if self.cache_mode == "off":
            return await self._compute(row, text)
        self.lookups += 1
        return await self.resolve(self.key(row, text), row, text)

    async def resolve(self, key: str, row: dict, text: str) -> VerifyResult:
        """The result for `key` (already counted as a lookup): local, then shared cache, else computed once."""
        if self.cache_mode == "global" and self.shared is None:
            with _global_lock:
                hit = _global.use(key)
            if hit is not None:
                self.hits += 1
                return hit
        hit = self.cache.use(key)
        if hit is not None:
            self.hits += 1
            return hit
        fut = self._inflight.get(key)
        if fut is not None:
            self.hits += 1
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            result, claimed = None, False
            shared = self.shared  # this call's: a claim taken is stored or released there even if the run
            # gives the shared cache up meanwhile (others may wait on the claim)
            if shared is not None:
                t = time.perf_counter()
                try:
                    result, claimed = await shared.get_or_claim(key)
                except Exception as exc:  # noqa: BLE001
                    self.shared_failed(exc)
                    shared = None
                else:
                    self._lookup[0] += 1
                    self._lookup[1] += time.perf_counter() - t
                    self._shared_found += result is not None
            if result is not None:
                self.hits += 1
            else:
                t = time.perf_counter()
                try:
                    result = await self._compute(row, text)
                except BaseException:
                    if claimed and shared is not None:
                        try:
                            await shared.release(key)
                        except Exception as exc:  # noqa: BLE001
                            self.shared_failed(exc)
                    raise
                if shared is not None:
                    self._computed[0] += 1
                    self._computed[1] += time.perf_counter() - t
                if claimed and shared is not None:  # stored in the background: nobody here waits for it
                    store = asyncio.ensure_future(shared.put(key, result))
                    self._storing.add(store)
                    store.add_done_callback(self._stored)
            if shared is not None and not self.choice:
                self._choose()
        except BaseException as exc:
            self._inflight.pop(key, None)  # errors (a judge timeout) are not remembered
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved
            raise
        self._inflight.pop(key, None)
        fut.set_result(result)
        self.cache.put(key, result)
        if self.cache_mode == "global" and self.shared is None:
            with _global_lock:
                _global.put(key, result)
        return result

    async def _compute(self, row: dict, text: str) -> VerifyResult:
        v, opts = self.verifier, self.options
        if self.kind == "cpu" and self.pooled is not None:
            self.waiting += 1
            try:
                return await self.pooled(self.name, row, text, opts, self.fast)
            finally:
                self.waiting -= 1
        if self.kind in ("loop", "cpu"):
            return v.fast_verify(row, text, opts) if self.fast else v.verify(row, text, opts)
        self.waiting += 1
        try:
            await self.sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            if self.kind == "io":
                fn = v.fast_verify if self.fast else v.verify
                return await asyncio.get_running_loop().run_in_executor(self.threads, fn, row, text, opts)
            if self.fast and v.has_fast:
                return v.fast_verify(row, text, opts)
            return await v.averify(row, text, opts)
        finally:
            self.running -= 1
            self.sem.release()

    async def aclose(self) -> None:
        if self._storing:  # the results still being stored
            await asyncio.gather(*list(self._storing), return_exceptions=True)
        for shared in [self.shared, *self._dropped]:
            if shared is not None:
                await shared.aclose()
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.verifier, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception:  # noqa: BLE001
                pass


def verify_items(items: list[tuple]) -> list[tuple]:
    """In a pool process: verify several (name, row, text, options, fast) items. One entry per item, in
    order: (True, VerifyResult) or (False, exception type name, message)."""
    from .base import verify_row

    out: list[tuple] = []
    for name, row, text, options, fast in items:
        try:
            out.append((True, verify_row(name, row, text, options, fast)))
        except Exception as exc:  # noqa: BLE001  (reported per rollout as a verifier error)
            out.append((False, type(exc).__name__, str(exc)))
    return out
