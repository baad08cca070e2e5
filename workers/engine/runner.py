"""The collection engine: tasks -> model server -> verifier -> sink, with bounded memory.

Shape of a run
--------------
* One session for the whole run (connector limit sized to parallelism), made by the outbound gate
  (workers.outbound.gated_session: allow-list, checked and pinned addresses, no redirects, capped reads).
* A feeder coroutine (workers.engine.feed) pulls TaskItems lazily from the given (async) iterable into a queue, never
  holding more than `max_resident` tasks (default: the workers plus `parallelism`) between reading a task and
  emitting its result (queued + in flight + being emitted). Plain synchronous iterators other than in-memory
  sequences are advanced in one dedicated thread, in small batches, so that an iterator that does
  blocking I/O (e.g. a database cursor) never blocks the event loop and always runs in the same thread.
* A fixed pool of worker coroutines takes tasks off the queue; a worker holds one task from request to emitted
  result. At most `parallelism` requests are in flight (RequestSlots): a worker gives its slot back when the
  answer is in, so with a verifier there are 2 x `parallelism` workers and the model server gets the next
  request while the last answer is verified (VERIFY_OFF_SLOT). At most `max_resident` tasks are in memory
  whatever the dataset size. The pool grows or shrinks when the control asks for another parallelism (idle
  workers retire at once, busy ones after their task).
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
  moment its request got a slot (after any client-side rate-limit pacing): time spent waiting for a
  parallelism slot (plus pacing).
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

from workers import outbound, tracing
from workers.disclosure import with_detail
from workers.verifiers import get_verifier
from workers.verifiers.base import Verifier
from workers.verifiers.execution import VerifyExecutor

from .attempt import Abandon, AttemptError, new_trace_id, send_attempt, traceparent
from .convert import build_request, response_text
from .fdlimit import check_open_file_limit
from .feed import END, RequestSlots, Residency, feed
from .materialize import merge_overrides, with_seed
from .sources import run_class_for
from .pacing import TokenBucket, backoff_delay
from .replicas import ReplicaCut, ReplicaSet
from .types import (
    CollectionSpec, Control, ControlState, FailureClass, ProgressTick, RolloutResult, RunSummary, Sink, TaskItem,
)
from .verify_pool import SHARED_VERIFY_POOL, RemoteVerifierError, VerifyBatcher, VerifyPool



log = logging.getLogger(__name__)

CONTROL_POLL_S = 0.5


# -------------------------------------------------------------------------------------------- the run

class CollectionRun:
    """One run of the engine, and the plug-in point of every rollout source (workers.engine.sources picks the
    class; workers.nemo_gym.engine subclasses it). The run owns slots, residency, pacing, control, progress
    and the sink; a source changes what one task does by overriding these hooks:

    * `process_task(item, t_enqueued)`: one task from its slot to its result; ends with `emit(result)`, or
      raises `Abandon` to drop the task when the run stops.
    * `attempt(url, body, result)`: one request; returns the answer or raises `AttemptError`.
    * `verify(row, response, result)`: scores a response into `result` (called when `self.verifier` is set).
    * `tick()`: the ProgressTick of the interval (a subclass adds to `tick.extra`).
    * `run(tasks)`: the whole run; a subclass that needs setup around it (a session, a background task)
      wraps `super().run(tasks)`.

    And calls these: `emit(result)` (count a finished rollout, hand it to the sink) and `stop(cancel, grace)`
    (stop taking tasks; e.g. when nothing was ever reachable). Everything with a leading underscore is the
    run's own machinery."""

    ROUTES_REPLICAS = True  # requests spread over base_urls by the ReplicaSet (NeMo Gym agent runs route their own)
    # A rollout's verification holds no request slot: twice the parallelism in workers, of which at most the
    # parallelism have a request in flight (RequestSlots), so the model server gets the next request while the
    # last answer is verified (at 200 ms a request and 64 in flight: 266 -> ~300 rollouts/s). Off for runs whose
    # process_task is their own (a NeMo Gym agent verifies inside its /run).
    VERIFY_OFF_SLOT = True

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
        self.overlap_verify = (self.VERIFY_OFF_SLOT and spec.verify_mode != "deferred" and bool(spec.verifier)
                               and spec.verifier != "none")
        self.request_slots = RequestSlots(self.target)
        self.resident = Residency(self._resident_limit())
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
                                        shared_claim_s=spec.verify_cache_claim_s,
                                        shared_choice=spec.verify_cache_shared_choice)
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
        self.busy_since: float | None = None  # first request sent since the last tick that saw none in flight
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
        # OpenTelemetry spans (workers.tracing): None when tracing is off, the only test the hot path then makes
        self.tracer: tracing.RunTracer | None = None
        if spec.tracing is not None:
            try:
                self.tracer = tracing.run_tracer(spec.tracing)
            except Exception:  # a broken exporter set-up never stops the collection
                log.exception("tracing disabled for this run")

        # interval counters for progress ticks
        self.tick_ok = 0
        self.tick_finished = 0
        self.tick_tokens = 0
        self.tick_errors: Counter = Counter()
        self.tick_replica_errors: Counter = Counter()
        self.last_tick = self.t0

    # ---------------------------------------------------------------- feeding
    def _workers_for(self, parallelism: int) -> int:
        return 2 * parallelism if self.overlap_verify else parallelism

    def _resident_limit(self) -> int:
        """max_resident (default: the workers and a queue of `parallelism` more), never below the workers."""
        workers = self._workers_for(self.target)
        return max(workers, int(self.spec.max_resident or workers + self.target))

    async def _feed(self, tasks):
        try:
            await feed(tasks, self.queue.put_nowait, self.resident, self.loop, self._task_thread)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the task iterator failed: stop the run with a clear message
            log.exception("task iterator failed")
            self.fatal_error = f"reading tasks failed: {type(exc).__name__}: {exc}"
            self.stop(cancel=True)
            return
        await self.queue.put(END)

    def _task_thread(self) -> ThreadPoolExecutor:
        """The one thread that advances a plain iterator (shut down when the run ends)."""
        self.iter_executor = ThreadPoolExecutor(1, thread_name_prefix="engine-tasks")
        return self.iter_executor

    # ---------------------------------------------------------------- workers
    def _spawn(self, n: int):
        for _ in range(n):
            self.n_workers += 1
            task = self.loop.create_task(self._worker())
            self.workers[task] = "idle"

    async def _worker(self):
        me = asyncio.current_task()
        try:
            while not self.stopping and self.n_workers <= self._workers_for(self.target):
                self.workers[me] = "idle"
                entry = await self.queue.get()
                if entry is END:
                    self.queue.put_nowait(END)  # let the other workers see it too
                    return
                if self.stopping:
                    return
                self.workers[me] = "busy"
                try:
                    await self.process_task(*entry)
                finally:
                    self.resident.release()
        except (asyncio.CancelledError, Abandon):
            pass
        except Exception as exc:  # a bug: surface it instead of silently losing a worker
            log.exception("engine worker failed")
            if not self.fatal_error:
                self.fatal_error = f"internal engine error: {type(exc).__name__}: {exc}"
            self.stop(cancel=True)
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
        self.request_slots.set_limit(n)
        self.resident.set_limit(self._resident_limit())
        connector = getattr(self, "connector", None)
        if connector is not None and hasattr(connector, "_limit") and connector._limit and connector._limit < n:
            connector._limit = n  # aiohttp has no public setter; the pool must never be the smaller bound
        workers = self._workers_for(n)
        if self.n_workers < workers:
            self._spawn(workers - self.n_workers)
        else:
            excess = self.n_workers - workers
            for task, state in list(self.workers.items()):
                if excess <= 0:
                    break
                if state == "idle":
                    task.cancel()
                    excess -= 1
            # busy workers over the target retire after their current task

    def stop(self, cancel: bool, grace: float = 0.0):
        """Stop taking tasks. cancel=True: cancel in-flight work now; else after `grace` seconds."""
        if not self.stopping:
            self.stopping = True
            self.stop_event.set()
            if self.feeder is not None:
                self.feeder.cancel()
            while not self.queue.empty():
                if self.queue.get_nowait() is not END:
                    self.resident.release()
            self.queue.put_nowait(END)
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

    async def process_task(self, item: TaskItem, t_enqueued: float):
        spec = self.spec
        row = merge_overrides(item.row, spec.responses_create_params)
        if spec.add_seed:
            row = with_seed(row, item.rollout_index)
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
        await self.request_slots.acquire()
        if self.stopping:  # paused or stopped while it waited for a slot: not started, collected by the next run
            self.request_slots.release()
            raise Abandon()
        t_slot = time.monotonic()
        result.queue_ms = (t_slot - t_enqueued) * 1000.0
        if self.tracer is not None:
            self._trace_rollout(result, t_slot - t_enqueued)
        self._slot_taken(t_slot)
        try:
            response, unreachable = None, False
            if body is not None:
                response, unreachable = await self._request_with_retries(path, body, result)
        finally:  # the slot goes to the next request; verification follows without it
            self.in_flight -= 1
            self.request_slots.release()
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
                await self.verify(row, response, result)
        elif unreachable and self.completed == 0 and self.other_outcomes == 0:
            # nothing has ever come back from the endpoint: stop the run, emit nothing
            if not self.fatal_error:
                self.fatal_error = result.error
            self.stop(cancel=True)
            raise Abandon()
        out_row["_ng_task_index"] = item.task_index
        out_row["_ng_rollout_index"] = item.rollout_index
        result.wall_ms = (time.monotonic() - t_slot) * 1000.0

        await self.emit(result)

    def _trace_rollout(self, result: RolloutResult, waited_s: float) -> None:
        """Start the rollout's span (tracing on): its trace id is the rollout's, set now."""
        if not result.trace_id:
            result.trace_id = new_trace_id()
        try:
            self.tracer.rollout_start(result, waited_s)
        except Exception:
            log.exception("tracing: rollout span")

    async def emit(self, result: RolloutResult) -> None:
        """Count a finished rollout and hand it to the sink (every kind of run ends a rollout here)."""
        if self.tracer is not None:
            try:
                self.tracer.rollout_end(result)
            except Exception:
                log.exception("tracing: rollout span")
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
            self.stop(cancel=True)
            raise Abandon() from exc
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
                        response = await replicas.track(idx, self.attempt(url, body, result))
                    else:
                        response = await self.attempt(url, body, result)
                except ReplicaCut as cut:
                    raise AttemptError(FailureClass.TIMEOUT, str(cut), True) from None
                replicas.succeeded(idx)
                return response, False
            except AttemptError as err:
                self.tick_errors[err.failure_class] += 1
                replica_fault = err.failure_class in (FailureClass.CONNECTION, FailureClass.TIMEOUT, FailureClass.HTTP_5XX)
                if err.failure_class in (FailureClass.CONNECTION, FailureClass.TIMEOUT):
                    self.tick_replica_errors[self.base_urls[idx]] += 1  # names a dead or hung replica
                replicas.failed(idx, str(err), replica_fault, err.unreachable)
                if not err.retryable or attempt >= ep.max_retries:
                    result.failure_class = err.failure_class
                    retries = f" after {attempt} retr{'y' if attempt == 1 else 'ies'}" if attempt else ""
                    if err.unreachable:
                        result.error = with_detail(f"cannot reach {self.base_urls[idx]}: {err}{retries}", err.detail)
                    else:
                        result.error = with_detail(f"{err}{retries}", err.detail)
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
                    raise Abandon()
                continue
            delay = backoff_delay(attempt - 1, ep.backoff_base_s, ep.backoff_max_s, retry_after)
            try:
                await asyncio.wait_for(self.stop_event.wait(), delay)
            except asyncio.TimeoutError:
                continue
            raise Abandon()  # stopping while backing off: leave the task for the next run

    async def attempt(self, url: str, body: dict, result: RolloutResult) -> dict:
        """One request of the rollout (attempt.send_attempt); AttemptError when it failed. Its `traceparent`
        carries the rollout's trace id and a new span id (the request span's when tracing is on)."""
        if not result.trace_id:  # the rollout's, for all its requests (model, agent, verifier)
            result.trace_id = new_trace_id()
        tracer = self.tracer
        if tracer is None:
            return await self._send(url, body, result, traceparent(result.trace_id))  # W3C: one span per attempt
        span, header = tracer.request(result, url)  # one call: the request span and its traceparent
        if span is None:  # a rollout outside the sample
            return await self._send(url, body, result, traceparent(result.trace_id))
        try:
            response = await self._send(url, body, result, header)
        except AttemptError as err:
            tracer.end(span, f"{err.failure_class}: {err}", {"error.type": err.failure_class})
            raise
        except BaseException as exc:
            tracer.end(span, type(exc).__name__)
            raise
        tracer.request_done(span, result.weight_version)
        return response

    async def _send(self, url: str, body: dict, result: RolloutResult, parent: str) -> dict:
        return await send_attempt(self.session, url, body, result, flavor=self.ep.api_flavor, stream=self.spec.stream,
                                  headers={**self.headers, "traceparent": parent}, timeout=self.timeout,
                                  connect_timeout_s=self.ep.connect_timeout_s, max_bytes=self.ep.max_response_bytes)

    async def verify(self, row: dict, response: dict, result: RolloutResult):
        spec = self.spec
        text = response_text(response)
        span = None if self.tracer is None else self.tracer.child(result, "verify", {"verifier.name": spec.verifier})
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
        finally:
            if span is not None:
                self.tracer.end(span, result.error if result.failure_class == FailureClass.VERIFIER_ERROR else "",
                                {"rollout.reward": result.reward})
        result.verify_ms = (time.monotonic() - t0) * 1000.0

    def _slot_taken(self, t_slot: float) -> None:
        """A request took its slot at t_slot (monotonic): one more in flight."""
        self.in_flight += 1
        if self.in_flight > self.max_in_flight_seen:
            self.max_in_flight_seen = self.in_flight
        if self.busy_since is None:
            self.busy_since = t_slot

    # ---------------------------------------------------------------- progress and control
    def tick(self) -> ProgressTick:
        """The run's progress now. extra["busy_s"]: seconds since the first request sent after the last tick
        that saw none in flight (the run's first request, for its first busy tick): how long the run has been
        at work before this tick, however late the tick comes."""
        now = time.monotonic()
        dt = max(1e-9, now - self.last_tick)
        tick = ProgressTick(
            elapsed_s=now - self.t0, completed=self.completed, failed=self.failed, in_flight=self.in_flight,
            parallelism=self.target, samples_per_s=self.tick_ok / dt, output_tokens_per_s=self.tick_tokens / dt,
            errors=dict(self.tick_errors),
            extra={"finished_per_s": self.tick_finished / dt, "queued": self.queue.qsize(), "resident": self.resident.used,
                   "max_in_flight": self.max_in_flight_seen, "interval_s": dt,
                   "busy_s": now - self.busy_since if self.busy_since is not None else 0.0},
        )
        if self.in_flight == 0:
            self.busy_since = None
        if self.vexec is not None:  # verification queue, busy slots, pool use and cache for the diagnosis
            tick.extra.update(self.vexec.stats())
            if self.batcher is not None:
                tick.extra.update(verify_pool_inflight=self.batcher.inflight, verify_pool_pending=len(self.batcher.pending),
                                  verify_pool_size=self.spec.verify_processes or os.cpu_count() or 1)
        if len(self.base_urls) > 1:
            tick.extra["replica_errors"] = dict(self.tick_replica_errors)
            self.tick_replica_errors = Counter()
        if self.ROUTES_REPLICAS:  # per-replica load, errors and rotation state (cumulative for this run); a
            tick.extra["replicas"] = self.replicas.snapshot()  # single URL too: the endpoint page's table
        self.tick_ok = self.tick_finished = self.tick_tokens = 0
        self.tick_errors = Counter()
        self.max_in_flight_seen = self.in_flight
        self.last_tick = now
        return tick

    async def _progress_loop(self):
        while True:
            await asyncio.sleep(self.spec.progress_interval_s)
            try:
                await self.sink.progress(self.tick())
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
                    self.stop(cancel=True)
                    return
                if state.action == "pause":
                    self.paused = True
                    self.stop(cancel=False, grace=float(getattr(self.spec, "pause_grace_s", 10.0)))
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
        aux: list[asyncio.Task] = []
        try:
            async with outbound.gated_session(limit=self.target, timeout=self.timeout, ttl_dns_cache=300,
                                              headers={"User-Agent": "rollout-engine"},
                                              max_bytes=self.ep.max_response_bytes) as session:
                self.connector = session.connector
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
                        self._spawn(self._workers_for(self.target))
                    await self.done_event.wait()
                except asyncio.CancelledError:  # the caller cancelled us: stop promptly, then re-raise
                    self.cancelled = True
                    self.stop(cancel=True)
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
                await self.sink.progress(self.tick())
            except Exception:
                log.exception("sink.progress failed")
            if self.vexec is not None:
                await self.vexec.aclose()
            for ex in (self.iter_executor, self.control_executor):
                if ex is not None:
                    ex.shutdown(wait=False, cancel_futures=True)
            try:
                await self.sink.close()
            finally:
                if self.tracer is not None:
                    await self._close_tracer()
        if self.sink_error is not None:
            raise self.sink_error
        return self._summary()

    def _summary(self) -> RunSummary:
        return RunSummary(
            completed=self.completed, failed=self.failed, cancelled=self.cancelled and not self.fatal_error,
            paused=self.paused and not self.cancelled and not self.fatal_error,
            elapsed_s=time.monotonic() - self.t0, fatal_error=self.fatal_error,
        )

    async def _close_tracer(self) -> None:
        """End the chunk span and flush the export, in a thread (the exporter's HTTP call blocks)."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.tracer.close, self._summary())
        except Exception:
            log.exception("tracing: closing the run's spans")


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
        run = run_class_for(spec, CollectionRun)(spec, sink, control, verify_pool)
    except ValueError as exc:
        await sink.close()
        return RunSummary(completed=0, failed=0, cancelled=False, paused=False, elapsed_s=0.0, fatal_error=str(exc))
    return await run.run(tasks)


def run_collection_sync(*args, **kwargs) -> RunSummary:
    """`run_collection(spec, tasks, sink, control=None, verify_pool=None)` in a fresh event loop (for threads,
    Celery tasks and scripts)."""
    from .loop import run

    return run(run_collection(*args, **kwargs))
