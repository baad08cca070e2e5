"""The collection engine: tasks -> model server -> verifier -> sink, with bounded memory.

Shape of a run
--------------
* One aiohttp ClientSession for the whole run (connector limit sized to parallelism).
* A feeder coroutine pulls TaskItems lazily from the given (async) iterable into a queue, never
  holding more than `max_resident` tasks (default 2 x parallelism) between reading a task and emitting
  its result (queued + in flight + being emitted). Plain synchronous iterators other than in-memory
  sequences are advanced in one dedicated thread, in small batches, so that an iterator that does
  blocking I/O (e.g. a database cursor) never blocks the event loop and always runs in the same thread.
* A fixed pool of `parallelism` worker coroutines takes tasks off the queue; a worker holds one task
  from request to emitted result, so at most `parallelism` tasks are in flight and at most
  `max_resident` tasks are in memory whatever the dataset size. The pool grows or shrinks when the
  control asks for another parallelism (idle workers retire at once, busy ones after their task).
* CPU-bound verifiers run in a process pool (`verify_pool.VerifyPool`; the shared one unless the run is given
  another), warmed (each process has run the verifier once) before the first task is read, so no timing
  includes the pool's cold start; verifications go to the pool in batches (`VerifyBatcher`: a batch of one when the pool is idle,
  everything that waited when it is busy), one IPC round trip per batch rather than per rollout.
* The control (if any) is polled in a thread every CONTROL_POLL_S. "pause" stops taking tasks, lets
  in-flight requests finish for up to `spec.pause_grace_s` and returns RunSummary(paused=True);
  "cancel" cancels in-flight requests at once and returns RunSummary(cancelled=True). Tasks not
  finished are never emitted: the caller collects them on the next run.

Timings recorded on each RolloutResult (milliseconds, monotonic clock):
* queue_ms: from the moment the task became resident (read from the iterator into the queue) to the
  moment a worker slot took it and any client-side rate-limit pacing let it go: time spent waiting for
  a parallelism slot (plus pacing).
* ttft_ms: request sent -> first generated token (streaming), or the whole request (not streaming),
  of the last (successful) attempt.
* generation_ms: first -> last generated token (streaming only; None otherwise).
* verify_ms: time spent in the verifier (including the process-pool hop and, for a pooled verifier, the
  wait for the pool while it verifies earlier rollouts).
* wall_ms: slot acquired -> verified, including retries and backoff (excludes queue_ms).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterable, Iterable

import aiohttp

from workers.verifiers import get_verifier
from workers.verifiers.base import Verifier
from workers.verifiers.execution import VerifyExecutor

from .convert import StreamAccumulator, build_request, convert_answer, decode_sse_events, response_text
from .fdlimit import check_open_file_limit
from .materialize import merge_overrides
from .sources import run_class_for
from .pacing import TokenBucket, backoff_delay, parse_retry_after
from .replicas import ReplicaCut, ReplicaSet
from .types import (
    CollectionSpec, Control, ControlState, FailureClass, ProgressTick, RolloutResult, RunSummary, Sink, TaskItem,
)
from .verify_pool import SHARED_VERIFY_POOL, RemoteVerifierError, VerifyBatcher, VerifyPool

log = logging.getLogger(__name__)

CONTROL_POLL_S = 0.5
WEIGHT_VERSION_HEADERS = ("X-Weight-Version", "X-Model-Weight-Version")
_ITER_BATCH = 64
_DRAIN_AFTER_DONE_S = 1.0  # how long a stream's end is awaited after [DONE] to keep its connection
_END = object()


# ------------------------------------------------------------------------------------------ helpers

class _Residency:
    """Counts tasks resident in the engine (read from the iterator, not yet emitted or dropped).

    Only the feeder acquires; workers release. The limit can be raised at runtime."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.event = asyncio.Event()

    async def acquire_up_to(self, k: int) -> int:
        while self.used >= self.limit:
            self.event.clear()
            await self.event.wait()
        got = min(k, self.limit - self.used)
        self.used += got
        return got

    def release(self, k: int = 1) -> None:
        self.used -= k
        if self.used < self.limit:
            self.event.set()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        if self.used < limit:
            self.event.set()


class _AttemptError(Exception):
    def __init__(self, failure_class: str, message: str, retryable: bool, retry_after: float | None = None,
                 unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable  # could not even connect (vs. a connection dropped mid-answer)
        self.failure_class = failure_class
        self.retryable = retryable
        self.retry_after = retry_after


class _Abandon(Exception):
    """The run is stopping: drop this task without emitting it."""


def _error_reason(exc: BaseException) -> str:
    """A short, human reason: "Connection refused", "Name or service not known", "Server disconnected"."""
    text = str(exc) or type(exc).__name__
    os_error = getattr(exc, "os_error", None) if isinstance(exc, aiohttp.ClientConnectorError) else exc
    if isinstance(os_error, OSError):
        errno_ = os_error.errno
        if isinstance(errno_, int) and errno_ > 0:
            text = os.strerror(errno_)
        elif os_error.strerror:
            text = str(os_error.strerror)
    return text


# -------------------------------------------------------------------------------------------- the run

class _Run:
    ROUTES_REPLICAS = True  # requests spread over base_urls by the ReplicaSet (NeMo Gym agent runs route their own)

    def __init__(self, spec: CollectionSpec, sink: Sink, control: Control | None, verify_pool: VerifyPool | None = None):
        if not spec.endpoint.base_urls:
            raise ValueError("EndpointSpec.base_urls is empty")
        self.spec = spec
        self.ep = spec.endpoint
        self.sink = sink
        self.control = control
        self.loop = asyncio.get_running_loop()
        self.t0 = time.monotonic()

        self.target = max(1, int(spec.parallelism))
        self.resident = _Residency(self._resident_limit())
        self.queue: asyncio.Queue = asyncio.Queue()  # bounded by self.resident

        # "/v1/..." is appended; an OpenAI-style base URL that already ends in /v1 is accepted as well
        self.base_urls = [u.rstrip("/").removesuffix("/v1") for u in self.ep.base_urls]
        self.headers = {"Authorization": f"Bearer {self.ep.api_key}"} if self.ep.api_key else {}
        self.replicas = ReplicaSet(
            self.base_urls, affinity=getattr(self.ep, "replica_affinity", True), headers=self.headers,
            health_path=getattr(self.ep, "health_path", "/health"), fail_threshold=getattr(self.ep, "replica_fail_threshold", 3),
            health_interval_s=getattr(self.ep, "health_interval_s", 5.0), probe_timeout_s=getattr(self.ep, "probe_timeout_s", 2.0),
            probe_max_s=getattr(self.ep, "probe_max_s", 10.0))
        read_timeout = getattr(self.ep, "read_timeout_s", None)
        if self.spec.stream:
            self.timeout = aiohttp.ClientTimeout(total=self.ep.request_timeout_s, sock_connect=self.ep.connect_timeout_s,
                                                 sock_read=read_timeout or self.ep.request_timeout_s)
        else:
            self.timeout = aiohttp.ClientTimeout(total=self.ep.request_timeout_s, sock_connect=self.ep.connect_timeout_s,
                                                 sock_read=None)
        self.rpm = TokenBucket(self.ep.rpm_limit) if self.ep.rpm_limit else None
        self.tpm = TokenBucket(self.ep.tpm_limit) if self.ep.tpm_limit else None
        self.avg_output_tokens = 256.0

        # verification
        self.verifier: Verifier | None = None
        self.vexec: VerifyExecutor | None = None  # kind routing + result cache (workers.verifiers.execution)
        self.verify_in_pool = False
        self.fast = spec.verify_mode == "fast"
        if spec.verify_mode != "deferred" and spec.verifier and spec.verifier != "none":
            self.verifier = get_verifier(spec.verifier)  # ValueError for an unknown name or bad options
            self.vexec = VerifyExecutor(spec.verifier, spec.verifier_options, fast=self.fast, cache=spec.verify_cache,
                                        concurrency=spec.verify_concurrency, shared_url=spec.verify_cache_url,
                                        shared_scope=spec.verify_cache_scope, shared_ttl_s=spec.verify_cache_ttl_s,
                                        shared_claim_s=spec.verify_cache_claim_s)
            self.verify_in_pool = self.vexec.needs_pool
        self.batcher = (VerifyBatcher(self.loop, spec.verify_processes, pool=verify_pool or SHARED_VERIFY_POOL)
                        if self.verify_in_pool else None)
        if self.vexec is not None and self.batcher is not None:
            self.vexec.pooled = self.batcher.verify

        # workers and state
        self.workers: dict[asyncio.Task, str] = {}  # task -> "idle" | "busy" | "emit"
        self.n_workers = 0
        self.in_flight = 0
        self.max_in_flight_seen = 0
        self.stopping = False
        self.stop_event = asyncio.Event()
        self.done_event = asyncio.Event()
        self.paused = False
        self.cancelled = False
        self.fatal_error = ""
        self.sink_error: BaseException | None = None
        self.completed = 0
        self.failed = 0
        self.other_outcomes = 0  # failed rows emitted (with `completed`: has anything come back at all?)
        self.feeder: asyncio.Task | None = None
        self.iter_executor: ThreadPoolExecutor | None = None
        self.control_executor: ThreadPoolExecutor | None = None

        # interval counters for progress ticks
        self.tick_ok = 0
        self.tick_finished = 0
        self.tick_tokens = 0
        self.tick_errors: Counter = Counter()
        self.tick_replica_errors: Counter = Counter()
        self.last_tick = self.t0

    # ---------------------------------------------------------------- feeding
    def _resident_limit(self) -> int:
        """max_resident (default 2 x parallelism), never below the current parallelism."""
        return max(self.target, int(self.spec.max_resident or 2 * self.target))

    async def _feed(self, tasks):
        put = self.queue.put_nowait
        monotonic = time.monotonic
        try:
            if hasattr(tasks, "__aiter__"):
                it = aiter(tasks)
                while True:
                    await self.resident.acquire_up_to(1)
                    try:
                        item = await anext(it)
                    except StopAsyncIteration:
                        self.resident.release()
                        break
                    put((item, monotonic()))
            elif isinstance(tasks, (list, tuple, range)):
                for item in tasks:
                    await self.resident.acquire_up_to(1)
                    put((item, monotonic()))
            else:
                it = iter(tasks)
                self.iter_executor = ThreadPoolExecutor(1, thread_name_prefix="engine-tasks")

                def take(n):
                    batch = []
                    for item in it:
                        batch.append(item)
                        if len(batch) >= n:
                            break
                    return batch

                while True:
                    n = await self.resident.acquire_up_to(_ITER_BATCH)
                    batch = await self.loop.run_in_executor(self.iter_executor, take, n)
                    now = monotonic()
                    for item in batch:
                        put((item, now))
                    if len(batch) < n:
                        self.resident.release(n - len(batch))
                        break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the task iterator failed: stop the run with a clear message
            log.exception("task iterator failed")
            self.fatal_error = f"reading tasks failed: {type(exc).__name__}: {exc}"
            self._stop(cancel=True)
            return
        await self.queue.put(_END)

    # ---------------------------------------------------------------- workers
    def _spawn(self, n: int):
        for _ in range(n):
            self.n_workers += 1
            task = self.loop.create_task(self._worker())
            self.workers[task] = "idle"

    async def _worker(self):
        me = asyncio.current_task()
        try:
            while not self.stopping and self.n_workers <= self.target:
                self.workers[me] = "idle"
                entry = await self.queue.get()
                if entry is _END:
                    self.queue.put_nowait(_END)  # let the other workers see it too
                    return
                if self.stopping:
                    return
                self.workers[me] = "busy"
                try:
                    await self._process(*entry)
                finally:
                    self.resident.release()
        except (asyncio.CancelledError, _Abandon):
            pass
        except Exception as exc:  # a bug: surface it instead of silently losing a worker
            log.exception("engine worker failed")
            if not self.fatal_error:
                self.fatal_error = f"internal engine error: {type(exc).__name__}: {exc}"
            self._stop(cancel=True)
        finally:
            self.workers.pop(me, None)
            self.n_workers -= 1
            if self.n_workers <= 0:
                self.done_event.set()

    def _set_parallelism(self, n: int):
        n = max(1, int(n))
        if n == self.target or self.stopping:
            return
        self.target = n
        self.resident.set_limit(self._resident_limit())
        connector = getattr(self, "connector", None)
        if connector is not None and hasattr(connector, "_limit") and connector._limit and connector._limit < n:
            connector._limit = n  # aiohttp has no public setter; the pool must never be the smaller bound
        if self.n_workers < n:
            self._spawn(n - self.n_workers)
        else:
            excess = self.n_workers - n
            for task, state in list(self.workers.items()):
                if excess <= 0:
                    break
                if state == "idle":
                    task.cancel()
                    excess -= 1
            # busy workers over the target retire after their current task

    def _stop(self, cancel: bool, grace: float = 0.0):
        """Stop taking tasks. cancel=True: cancel in-flight work now; else after `grace` seconds."""
        if not self.stopping:
            self.stopping = True
            self.stop_event.set()
            if self.feeder is not None:
                self.feeder.cancel()
            while not self.queue.empty():
                if self.queue.get_nowait() is not _END:
                    self.resident.release()
            self.queue.put_nowait(_END)
            for task, state in list(self.workers.items()):
                if state == "idle":
                    task.cancel()
        if cancel or grace <= 0:
            self._cancel_busy()
        else:
            self.loop.call_later(grace, self._cancel_busy)

    def _cancel_busy(self):
        for task, state in list(self.workers.items()):
            if state != "emit":  # a result being handed to the sink is let through
                task.cancel()

    # ---------------------------------------------------------------- one task
    def _estimate_tokens(self, body: dict) -> float:
        prompt = body.get("messages") or body.get("prompt") or body.get("input") or ""
        chars = len(prompt) if isinstance(prompt, str) else len(json.dumps(prompt))
        out = body.get("max_tokens") or body.get("max_output_tokens") or self.avg_output_tokens
        return chars / 4 + float(out)

    async def _process(self, item: TaskItem, t_enqueued: float):
        spec = self.spec
        row = merge_overrides(item.row, spec.responses_create_params)
        out_row = dict(row)
        result = RolloutResult(task_index=item.task_index, rollout_index=item.rollout_index, ok=False, output_row=out_row, attempts=0)
        try:
            path, body = build_request(self.ep.api_flavor, row.get("responses_create_params") or {}, self.ep.model, spec.stream)
        except (ValueError, TypeError, KeyError) as exc:
            body = None
            result.failure_class = FailureClass.BAD_INPUT
            result.error = f"cannot build the request from this row: {exc}"

        estimate = 0.0
        if body is not None:
            if self.rpm is not None:
                await self.rpm.acquire(1)
            if self.tpm is not None:
                estimate = self._estimate_tokens(body)
                await self.tpm.acquire(estimate)
        t_slot = time.monotonic()
        result.queue_ms = (t_slot - t_enqueued) * 1000.0
        self.in_flight += 1
        if self.in_flight > self.max_in_flight_seen:
            self.max_in_flight_seen = self.in_flight
        try:
            response, unreachable = None, False
            if body is not None:
                response, unreachable = await self._request_with_retries(path, body, result)
            if response is not None:
                usage = response.get("usage") or {}
                result.input_tokens = usage.get("input_tokens")
                result.output_tokens = usage.get("output_tokens")
                if self.tpm is not None and usage:
                    self.tpm.adjust(float(usage.get("total_tokens") or 0) - estimate)
                if result.output_tokens:
                    self.avg_output_tokens = 0.95 * self.avg_output_tokens + 0.05 * result.output_tokens
                out_row["response"] = response
                result.ok = True
                if self.verifier is not None:
                    await self._verify(row, response, result)
            elif unreachable and self.completed == 0 and self.other_outcomes == 0:
                # nothing has ever come back from the endpoint: stop the run, emit nothing
                if not self.fatal_error:
                    self.fatal_error = result.error
                self._stop(cancel=True)
                raise _Abandon()
            out_row["_ng_task_index"] = item.task_index
            out_row["_ng_rollout_index"] = item.rollout_index
            result.wall_ms = (time.monotonic() - t_slot) * 1000.0
        finally:
            self.in_flight -= 1

        await self._emit(result)

    async def _emit(self, result: RolloutResult) -> None:
        """Count a finished rollout and hand it to the sink (every kind of run ends a rollout here)."""
        if result.ok:
            self.completed += 1
            self.tick_ok += 1
            self.tick_tokens += result.output_tokens or 0
        else:
            self.failed += 1
            self.other_outcomes += 1
        self.tick_finished += 1
        me = asyncio.current_task()
        self.workers[me] = "emit"
        try:
            await self.sink.rollout(result)
        except Exception as exc:
            log.exception("sink.rollout failed")
            if self.sink_error is None:
                self.sink_error = exc
            self._stop(cancel=True)
            raise _Abandon() from exc
        finally:
            if me in self.workers:
                self.workers[me] = "busy"

    async def _request_with_retries(self, path: str, body: dict, result: RolloutResult) -> tuple[dict | None, bool]:
        """(response, False) on success; (None, unreachable) once the retry budget is spent or the error is
        not retryable, with result.failure_class / error / attempts filled in.

        Several replicas: each attempt goes where `ReplicaSet.pick` says (affinity by task index, else least
        outstanding); an attempt that fails with a replica fault (connection, timeout, 5xx) is retried at once
        on another replica in rotation when there is one, else after the usual backoff."""
        ep = self.ep
        replicas = self.replicas
        attempt = 0
        tried: set[int] = set()  # replicas that failed this request with a replica fault
        while True:
            if len(tried) >= replicas.n:
                tried.clear()
            idx = replicas.pick(result.task_index, tried)
            url = self.base_urls[idx] + path
            result.attempts = attempt + 1
            if replicas.n > 1:
                result.replica = self.base_urls[idx]
            replicas.begin(idx)
            switch = False
            try:
                try:
                    if replicas.n > 1 and self.ROUTES_REPLICAS:
                        response = await replicas.track(idx, self._attempt(url, body, result))
                    else:
                        response = await self._attempt(url, body, result)
                except ReplicaCut as cut:
                    raise _AttemptError(FailureClass.TIMEOUT, str(cut), True) from None
                replicas.succeeded(idx)
                return response, False
            except _AttemptError as err:
                self.tick_errors[err.failure_class] += 1
                replica_fault = err.failure_class in (FailureClass.CONNECTION, FailureClass.TIMEOUT, FailureClass.HTTP_5XX)
                if err.failure_class in (FailureClass.CONNECTION, FailureClass.TIMEOUT):
                    self.tick_replica_errors[self.base_urls[idx]] += 1  # names a dead or hung replica
                replicas.failed(idx, str(err), replica_fault, err.unreachable)
                if not err.retryable or attempt >= ep.max_retries:
                    result.failure_class = err.failure_class
                    retries = f" after {attempt} retr{'y' if attempt == 1 else 'ies'}" if attempt else ""
                    if err.unreachable:
                        result.error = f"cannot reach {self.base_urls[idx]}: {err}{retries}"
                    else:
                        result.error = f"{err}{retries}"
                    return None, err.unreachable
                retry_after = err.retry_after
                if replica_fault and replicas.n > 1:
                    tried.add(idx)
                    switch = replicas.in_rotation(tried) > 0  # a live replica is left: go there now
            finally:
                replicas.end(idx)
            attempt += 1
            if switch:
                if self.stopping:
                    raise _Abandon()
                continue
            delay = backoff_delay(attempt - 1, ep.backoff_base_s, ep.backoff_max_s, retry_after)
            try:
                await asyncio.wait_for(self.stop_event.wait(), delay)
            except asyncio.TimeoutError:
                continue
            raise _Abandon()  # stopping while backing off: leave the task for the next run

    async def _attempt(self, url: str, body: dict, result: RolloutResult) -> dict:
        flavor = self.ep.api_flavor
        t_sent = time.monotonic()
        try:
            cap = self.ep.max_response_bytes
            async with self.session.post(url, json=body, headers=self.headers, timeout=self.timeout,
                                         allow_redirects=False) as resp:
                status = resp.status
                if (resp.content_length or 0) > cap:
                    raise _AttemptError(FailureClass.BAD_RESPONSE, f"response from {url} over {cap} bytes", False)
                if status != 200:
                    text = (await resp.content.read(4096)).decode("utf-8", "replace")[:300]
                    retry_after = parse_retry_after(resp.headers.get("Retry-After"))
                    if status == 429:
                        raise _AttemptError(FailureClass.HTTP_429, f"HTTP 429 from {url}: {text}", True, retry_after)
                    if status >= 500:
                        raise _AttemptError(FailureClass.HTTP_5XX, f"HTTP {status} from {url}: {text}", True, retry_after)
                    if status == 408:
                        raise _AttemptError(FailureClass.TIMEOUT, f"HTTP 408 from {url}: {text}", True, retry_after)
                    raise _AttemptError(FailureClass.HTTP_4XX, f"HTTP {status} from {url}: {text}", status == 409, retry_after)
                for name in WEIGHT_VERSION_HEADERS:
                    if name in resp.headers:
                        result.weight_version = resp.headers[name]
                        break
                ctype = resp.headers.get("Content-Type", "")
                if self.spec.stream and "text/event-stream" in ctype:
                    acc = StreamAccumulator(flavor)
                    t_first = t_last = None
                    buf = b""
                    done = False
                    seen = 0
                    async for chunk in resp.content.iter_any():
                        seen += len(chunk)
                        if seen > cap:
                            raise _AttemptError(FailureClass.BAD_RESPONSE, f"response from {url} over {cap} bytes", False)
                        buf += chunk
                        if b"\n" not in chunk:
                            continue
                        t_chunk = time.monotonic()  # the events of one read arrived together
                        lines = buf.split(b"\n")
                        buf = lines.pop()
                        events = []
                        for line in lines:
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if not data:
                                continue
                            if data == b"[DONE]":
                                done = True
                                break
                            events.append(data)
                        for event in decode_sse_events(events):
                            if acc.feed(event):
                                t_last = t_chunk
                                if t_first is None:
                                    t_first = t_chunk
                        if done:
                            break
                    if done and not resp.content.at_eof():
                        await self._drain_after_done(resp)
                    if not done and acc.id is None and acc.final is None:
                        raise _AttemptError(FailureClass.CONNECTION, f"stream from {url} ended before any data", True)
                    response = acc.response()
                    now = time.monotonic()
                    result.ttft_ms = ((t_first or now) - t_sent) * 1000.0
                    result.generation_ms = ((t_last or now) - (t_first or now)) * 1000.0
                else:
                    raw = bytearray()
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        raw += chunk
                        if len(raw) > cap:
                            raise _AttemptError(FailureClass.BAD_RESPONSE, f"response from {url} over {cap} bytes", False)
                    payload = json.loads(raw)
                    if isinstance(payload, dict) and payload.get("weight_version") and not result.weight_version:
                        result.weight_version = str(payload["weight_version"])
                    response = convert_answer(flavor, payload)
                    result.ttft_ms = (time.monotonic() - t_sent) * 1000.0
                    result.generation_ms = None
                return response
        except _AttemptError:
            raise
        except aiohttp.ConnectionTimeoutError as exc:
            raise _AttemptError(FailureClass.CONNECTION, f"connect timed out after {self.ep.connect_timeout_s:g}s", True,
                                unreachable=True) from exc
        except aiohttp.ClientConnectorError as exc:
            raise _AttemptError(FailureClass.CONNECTION, _error_reason(exc), True, unreachable=True) from exc
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            elapsed = time.monotonic() - t_sent
            raise _AttemptError(FailureClass.TIMEOUT, f"request to {url} timed out after {elapsed:.1f}s", True) from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
            raise _AttemptError(FailureClass.CONNECTION, _error_reason(exc), True) from exc
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # JSON or shape errors
            raise _AttemptError(FailureClass.BAD_RESPONSE, f"bad response from {url}: {type(exc).__name__}: {exc}", False) from exc

    @staticmethod
    async def _drain_after_done(resp) -> None:
        """Read the end of a stream after `[DONE]` (the chunked body's last chunk, which often arrives in a
        later read): a response released before its end closes its connection, and at thousands of requests
        in flight a new TCP connection per request costs more CPU than the request itself. A server that
        keeps the stream open after `[DONE]` only loses the connection, as before."""
        try:
            await asyncio.wait_for(resp.content.read(), _DRAIN_AFTER_DONE_S)
        except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError):
            pass

    async def _verify(self, row: dict, response: dict, result: RolloutResult):
        spec = self.spec
        text = response_text(response)
        t0 = time.monotonic()
        try:
            vr = await self.vexec.verify(row, text)
            reward = float(vr.reward)
            result.output_row["reward"] = reward
            result.output_row.update(vr.fields or {})
            result.reward = reward
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            result.ok = False
            result.failure_class = FailureClass.VERIFIER_ERROR
            kind = exc.type_name if isinstance(exc, RemoteVerifierError) else type(exc).__name__
            result.error = f"verifier {spec.verifier!r} raised {kind}: {exc}"[:2000]
            result.reward = 0.0
            result.output_row["reward"] = 0.0
            self.tick_errors[FailureClass.VERIFIER_ERROR] += 1
        result.verify_ms = (time.monotonic() - t0) * 1000.0

    # ---------------------------------------------------------------- progress and control
    def _tick(self) -> ProgressTick:
        now = time.monotonic()
        dt = max(1e-9, now - self.last_tick)
        tick = ProgressTick(
            elapsed_s=now - self.t0, completed=self.completed, failed=self.failed, in_flight=self.in_flight,
            parallelism=self.target, samples_per_s=self.tick_ok / dt, output_tokens_per_s=self.tick_tokens / dt,
            errors=dict(self.tick_errors),
            extra={"finished_per_s": self.tick_finished / dt, "queued": self.queue.qsize(), "resident": self.resident.used,
                   "max_in_flight": self.max_in_flight_seen, "interval_s": dt},
        )
        if self.vexec is not None:  # verification queue, busy slots, pool use and cache for the diagnosis
            tick.extra.update(self.vexec.stats())
            if self.batcher is not None:
                tick.extra.update(verify_pool_inflight=self.batcher.inflight, verify_pool_pending=len(self.batcher.pending),
                                  verify_pool_size=self.spec.verify_processes or os.cpu_count() or 1)
        if len(self.base_urls) > 1:
            tick.extra["replica_errors"] = dict(self.tick_replica_errors)
            self.tick_replica_errors = Counter()
            if self.ROUTES_REPLICAS:  # per-replica load, errors and rotation state (cumulative for this run)
                tick.extra["replicas"] = self.replicas.snapshot()
        self.tick_ok = self.tick_finished = self.tick_tokens = 0
        self.tick_errors = Counter()
        self.max_in_flight_seen = self.in_flight
        self.last_tick = now
        return tick

    async def _progress_loop(self):
        while True:
            await asyncio.sleep(self.spec.progress_interval_s)
            try:
                await self.sink.progress(self._tick())
            except Exception:
                log.exception("sink.progress failed")

    async def _control_loop(self):
        self.control_executor = ThreadPoolExecutor(1, thread_name_prefix="engine-control")
        while not self.stopping:
            try:
                state: ControlState = await self.loop.run_in_executor(self.control_executor, self.control.poll)
            except Exception:
                log.exception("control.poll failed")
                state = None
            if state is not None:
                if state.action == "cancel":
                    self.cancelled = True
                    self._stop(cancel=True)
                    return
                if state.action == "pause":
                    self.paused = True
                    self._stop(cancel=False, grace=float(getattr(self.spec, "pause_grace_s", 10.0)))
                    return
                if state.parallelism:
                    self._set_parallelism(state.parallelism)
            await asyncio.sleep(CONTROL_POLL_S)

    async def _warm_verify_pool(self):
        """Warm the verifier processes before any request is sent, so that no rollout's timings include
        their cold start (see VerifyBatcher.warm)."""
        await self.batcher.warm(self.spec.verifier, self.stop_event, log)

    # ---------------------------------------------------------------- main
    async def run(self, tasks) -> RunSummary:
        check_open_file_limit(self.target)  # one socket per request in flight
        self.connector = aiohttp.TCPConnector(limit=self.target, limit_per_host=0, ttl_dns_cache=300)
        aux: list[asyncio.Task] = []
        try:
            async with aiohttp.ClientSession(connector=self.connector, timeout=self.timeout,
                                             headers={"User-Agent": "rollout-engine"}) as session:
                self.session = session
                aux.append(self.loop.create_task(self._progress_loop()))
                if self.ROUTES_REPLICAS and self.replicas.n > 1:
                    aux.append(self.loop.create_task(self.replicas.probe_loop()))
                if self.control is not None:
                    aux.append(self.loop.create_task(self._control_loop()))
                try:
                    if self.verify_in_pool:  # before the first task is read: no timing includes the pool's start
                        await self._warm_verify_pool()
                    if self.stopping:  # cancelled or paused while the pool was starting
                        self.done_event.set()
                    else:
                        self.feeder = self.loop.create_task(self._feed(tasks))
                        self._spawn(self.target)
                    await self.done_event.wait()
                except asyncio.CancelledError:  # the caller cancelled us: stop promptly, then re-raise
                    self.cancelled = True
                    self._stop(cancel=True)
                    await asyncio.gather(*self.workers, return_exceptions=True)
                    raise
                if self.feeder is not None:
                    if not self.feeder.done():
                        self.feeder.cancel()
                    await asyncio.gather(self.feeder, return_exceptions=True)
        finally:
            for task in aux:
                task.cancel()
            await asyncio.gather(*aux, return_exceptions=True)
            try:
                await self.sink.progress(self._tick())
            except Exception:
                log.exception("sink.progress failed")
            if self.vexec is not None:
                await self.vexec.aclose()
            for ex in (self.iter_executor, self.control_executor):
                if ex is not None:
                    ex.shutdown(wait=False, cancel_futures=True)
            await self.sink.close()
        if self.sink_error is not None:
            raise self.sink_error
        return RunSummary(
            completed=self.completed, failed=self.failed, cancelled=self.cancelled and not self.fatal_error,
            paused=self.paused and not self.cancelled and not self.fatal_error,
            elapsed_s=time.monotonic() - self.t0, fatal_error=self.fatal_error,
        )


async def run_collection(
    spec: CollectionSpec,
    tasks: Iterable[TaskItem] | AsyncIterable[TaskItem],
    sink: Sink,
    control: Control | None = None,
    verify_pool: VerifyPool | None = None,
) -> RunSummary:
    """Collect one rollout per TaskItem and hand each result to `sink` (see the module docstring).

    Returns a RunSummary; `fatal_error` is set when the run stopped early (endpoint unreachable before
    any success, unknown verifier, the task iterator failing). Exceptions from the sink propagate.
    CPU-bound verifiers run in `verify_pool` (default: the process's shared pool).
    """
    try:
        # other sources (NeMo Gym agents' /run, remote /verify) are registered by their packages
        run = run_class_for(spec, _Run)(spec, sink, control, verify_pool)
    except ValueError as exc:
        await sink.close()
        return RunSummary(completed=0, failed=0, cancelled=False, paused=False, elapsed_s=0.0, fatal_error=str(exc))
    return await run.run(tasks)


def run_collection_sync(*args, **kwargs) -> RunSummary:
    """`run_collection(spec, tasks, sink, control=None, verify_pool=None)` in a fresh event loop (for threads,
    Celery tasks and scripts)."""
    from .loop import run

    return run(run_collection(*args, **kwargs))
