"""The process pool that runs CPU-bound verifiers, as an object the engine is given (or uses the shared one).

A `VerifyPool` owns one `ProcessPoolExecutor`, created on first use and reused across runs (a Celery worker
runs many jobs; starting processes and importing sympy each time is costly), replaced when another size is
asked for or when it breaks. `SHARED_VERIFY_POOL` is the one a process uses unless a run is given another;
`VerifyPool(initializer=...)` makes a pool whose processes import more than `workers.verifiers` (scenario
verifiers, for instance).

`VerifyBatcher` hands verifications to a pool in batches (a batch of one when the pool is idle, everything
that waited when it is busy), one IPC round trip per batch rather than per rollout.
"""
from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from workers.verifiers import verify_row


def _mp_context():
    """forkserver where available (never fork: the engine often runs in a thread of a threaded process)."""
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["workers.verifiers", "math_verify"])
        return ctx
    return multiprocessing.get_context("spawn")


def _warm_verifier(name: str) -> int:
    """In a pool process: run the verifier once (sympy / math-verify's lazy set-up), then hold the process a
    moment so that the next warm-up call lands on another process of the pool."""
    try:
        verify_row(name, {"expected_answer": "2"}, "The answer is \\boxed{2}")
    except Exception:  # noqa: BLE001  (a verifier that needs other fields is still imported and set up)
        pass
    time.sleep(0.2)
    return os.getpid()


def _verify_batch(items: list[tuple]) -> list[tuple]:
    """In a pool process: verify several rollouts. One entry per item, in order:
    (True, VerifyResult) or (False, exception type name, message)."""
    out: list[tuple] = []
    for name, row, text, options, fast in items:
        try:
            out.append((True, verify_row(name, row, text, options, fast)))
        except Exception as exc:  # noqa: BLE001  (reported per rollout as a verifier error)
            out.append((False, type(exc).__name__, str(exc)))
    return out


class RemoteVerifierError(Exception):
    """A verifier raised in a pool process; `type_name` is the original exception's class name."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


class VerifyPool:
    """A lazily created, reusable process pool for verifiers (thread-safe).

    `initializer(*initargs)` runs in each process as it starts (e.g. to import a module that registers more
    verifiers). `size=None` at `executor()` means one process per core."""

    def __init__(self, initializer: Callable | None = None, initargs: tuple = ()):
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None
        self._size = 0
        self.initializer = initializer
        self.initargs = initargs

    def executor(self, size: int | None = None) -> ProcessPoolExecutor:
        """The pool's executor with `size` processes, started if needed (another size replaces it)."""
        size = max(1, size or os.cpu_count() or 1)
        with self._lock:
            if self._executor is not None and self._size != size:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
            if self._executor is None:
                self._executor = ProcessPoolExecutor(max_workers=size, mp_context=_mp_context(),
                                                     initializer=self.initializer, initargs=self.initargs)
                self._size = size
            return self._executor

    def configure(self, initializer: Callable | None, initargs: tuple = (), size: int | None = None) -> ProcessPoolExecutor:
        """Replace the processes by ones started with `initializer(*initargs)`, and start them now."""
        self.shutdown(wait=False)
        self.initializer, self.initargs = initializer, initargs
        executor = self.executor(size)
        if initializer is not None:  # start the processes now, so the first rollouts do not pay for it
            list(executor.map(initializer, *([arg] * executor._max_workers for arg in initargs)))
        return executor

    def shutdown(self, wait: bool = True) -> None:
        """Stop the verifier processes (the next `executor()` starts new ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=True)

    def discard_broken(self, executor: ProcessPoolExecutor) -> None:
        """Forget `executor` (a BrokenProcessPool): the next `executor()` starts a fresh one."""
        with self._lock:
            if self._executor is executor:
                self._executor = None
        executor.shutdown(wait=False, cancel_futures=True)


SHARED_VERIFY_POOL = VerifyPool()
atexit.register(SHARED_VERIFY_POOL.shutdown, False)


def get_verify_pool(size: int | None = None) -> ProcessPoolExecutor:
    """The shared pool's executor (see `VerifyPool.executor`)."""
    return SHARED_VERIFY_POOL.executor(size)


def shutdown_verify_pool(wait: bool = True) -> None:
    """Stop the shared pool's processes."""
    SHARED_VERIFY_POOL.shutdown(wait)


class VerifyBatcher:
    """Hands CPU-bound verifications to a VerifyPool in batches.

    At most `pool size + 1` submits are in flight (one per process, plus one queued so a process never
    waits for the round trip); each carries everything that waited meanwhile, up to `max_batch`. When the
    pool is idle a batch of one goes out at once (no added latency); when it is busy, one pickle, one
    pipe round trip and one executor wake-up serve a whole batch instead of one rollout each, which
    keeps the event loop's thread (and the GIL) free for HTTP and the sink."""

    def __init__(self, loop: asyncio.AbstractEventLoop, processes: int | None, max_batch: int = 32,
                 pool: VerifyPool | None = None):
        self.loop = loop
        self.processes = processes
        self.max_batch = max_batch
        self.pool = pool or SHARED_VERIFY_POOL
        self.pending: deque = deque()
        self.inflight = 0

    def verify(self, name: str, row: dict, text: str, options: dict, fast: bool) -> asyncio.Future:
        fut = self.loop.create_future()
        self.pending.append(((name, row, text, options, fast), fut))
        self._dispatch()
        return fut

    def _dispatch(self) -> None:
        executor = None
        while self.pending:
            if executor is None:
                executor = self.pool.executor(self.processes)
            if self.inflight >= executor._max_workers + 1:
                return
            batch = []
            while self.pending and len(batch) < self.max_batch:
                args, fut = self.pending.popleft()
                if not fut.done():  # a cancelled waiter (the run is stopping) needs no verification
                    batch.append((args, fut))
            if not batch:
                return
            try:
                cfut = executor.submit(_verify_batch, [args for args, _ in batch])
            except Exception as exc:  # BrokenProcessPool, or a pool shut down under us
                if isinstance(exc, BrokenProcessPool):
                    self.pool.discard_broken(executor)
                executor = None
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.inflight += 1
            afut = asyncio.wrap_future(cfut, loop=self.loop)
            afut.add_done_callback(lambda f, batch=batch, executor=executor: self._done(f, batch, executor))

    def _done(self, afut: asyncio.Future, batch: list, executor) -> None:
        self.inflight -= 1
        exc = asyncio.CancelledError() if afut.cancelled() else afut.exception()
        if isinstance(exc, BrokenProcessPool):
            self.pool.discard_broken(executor)
        results = afut.result() if exc is None else None
        for i, (_, fut) in enumerate(batch):
            if fut.done():
                continue
            if exc is not None:
                fut.set_exception(exc)
            elif results[i][0]:
                fut.set_result(results[i][1])
            else:
                fut.set_exception(RemoteVerifierError(results[i][1], results[i][2]))
        self._dispatch()

    async def warm(self, verifier: str, stop_event: asyncio.Event, log) -> None:
        """Start the processes and run the verifier once in each (sympy / math-verify set-up takes seconds on
        a cold start). Once per executor: later runs in the same process find it warm. Returns early when
        `stop_event` is set."""
        executor = self.pool.executor(self.processes)
        if getattr(executor, "_engine_warm", False):
            return
        warm = asyncio.gather(*(self.loop.run_in_executor(executor, _warm_verifier, verifier)
                                for _ in range(executor._max_workers)))
        stop = self.loop.create_task(stop_event.wait())
        t = time.monotonic()
        try:
            done, _ = await asyncio.wait({warm, stop}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
            if warm in done:
                pids = warm.result()
                executor._engine_warm = True
                log.info("verifier pool warm (%d processes, %.1fs)", len(set(pids)), time.monotonic() - t)
            elif stop not in done:
                log.warning("verifier pool not warm after 120 s; starting anyway")
        except Exception as exc:  # a broken pool: verification reports per-row errors, the run goes on
            if isinstance(exc, BrokenProcessPool):
                self.pool.discard_broken(executor)
            log.warning("warming the verifier pool failed: %s: %s", type(exc).__name__, exc)
        finally:
            stop.cancel()
            if not warm.done():
                warm.cancel()
                warm.add_done_callback(lambda f: f.cancelled() or f.exception())
