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
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

import psutil

from workers.profiling.core import unwrap_result, verify_call
from workers.verifiers import verify_row
from workers.verifiers.execution import verify_items

from . import forkserver


def _mp_context():
    return forkserver.context()


log = logging.getLogger(__name__)

# How often a pool process checks that the process owning the pool still lives.
OWNER_CHECK_INTERVAL_S = 0.5


def _owner_identity() -> tuple[int, float]:
    """(pid, start time) of this process: a pid alone could be reused by an unrelated process."""
    return os.getpid(), psutil.Process().create_time()


def _owner_gone(pid: int, create_time: float) -> bool:
    try:
        owner = psutil.Process(pid)
        return owner.create_time() != create_time or owner.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _watch_owner(pid: int, create_time: float) -> None:
    while not _owner_gone(pid, create_time):
        time.sleep(OWNER_CHECK_INTERVAL_S)
    os._exit(0)  # the owner was killed (SIGKILL runs no atexit): nobody will ever send this process work


def _pool_process_start(owner: tuple[int, float], initializer: Callable | None, initargs: tuple) -> None:
    """Runs first in every pool process. A forkserver child's parent is the fork server, not the process that
    owns the pool, so neither PR_SET_PDEATHSIG nor multiprocessing's parent sentinel notices that owner being
    SIGKILLed; the processes (and the fork server, which lives while they do) would idle on for good. A daemon
    thread watches the owner instead and ends the process within OWNER_CHECK_INTERVAL_S of its death."""
    threading.Thread(target=_watch_owner, args=owner, name="verify-pool-owner-watch", daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


class VerifierCrashed(Exception):
    """The pool process verifying a rollout died (os._exit, a segfault, the OOM killer)."""


def _warm_verifier(name: str) -> int:
    """In a pool process: run the verifier once (sympy / math-verify's lazy set-up; math's is done in the fork
    server already, see pool_preload), then hold the process a moment so that the next warm-up call lands on
    another process of the pool, if it has started by then."""
    try:
        verify_row(name, {"expected_answer": "2"}, "The answer is \\boxed{2}")
    except Exception:  # noqa: BLE001  (a verifier that needs other fields is still imported and set up)
        pass
    time.sleep(0.05)
    return os.getpid()


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
                self._executor = ProcessPoolExecutor(
                    max_workers=size, mp_context=_mp_context(), initializer=_pool_process_start,
                    initargs=(_owner_identity(), self.initializer, self.initargs))
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

    def prewarm(self, verifier: str, size: int | None = None) -> None:
        """Start the processes and run `verifier` once in each, now (blocking; the CLI calls it from a thread
        while Django sets up). An engine run meanwhile does not wait for it (VerifyBatcher.warm)."""
        executor = self.executor(size)
        if getattr(executor, "_engine_warm", False):
            return
        executor._engine_warming = True
        list(executor.map(_warm_verifier, [verifier] * executor._max_workers))
        executor._engine_warm = True

    def kill(self) -> None:
        """Kill the verifier processes at once (a process about to exit: nothing waits for them), and remove the
        pool's named semaphores: without a shutdown nothing else does, and multiprocessing's resource tracker
        then warns at exit of "5 leaked semaphore objects" (and removes them itself)."""
        executor = self._executor
        for proc in list((getattr(executor, "_processes", None) or {}).values()):
            try:
                proc.kill()
            except Exception:  # noqa: BLE001
                pass
        _unlink_semaphores(executor)

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


def _unlink_semaphores(executor) -> None:
    """Unlink the named semaphores of a killed pool's queues (their locks and the call queue's bound)."""
    from multiprocessing.synchronize import SemLock

    for queue_name in ("_call_queue", "_result_queue"):
        q = getattr(executor, queue_name, None)
        for lock_name in ("_rlock", "_wlock", "_sem"):
            lock = getattr(q, lock_name, None)
            name = getattr(getattr(lock, "_semlock", None), "name", None)
            if name:
                try:
                    SemLock._cleanup(name)  # sem_unlink, and the resource tracker forgets it
                except Exception:  # noqa: BLE001 (already gone)
                    pass


SHARED_VERIFY_POOL = VerifyPool()
atexit.register(SHARED_VERIFY_POOL.shutdown, False)


def get_verify_pool(size: int | None = None) -> ProcessPoolExecutor:
    """The shared pool's executor (see `VerifyPool.executor`)."""
    return SHARED_VERIFY_POOL.executor(size)


def shutdown_verify_pool(wait: bool = True) -> None:
    """Stop the shared pool's processes."""
    SHARED_VERIFY_POOL.shutdown(wait)


def _exit_codes(executor: ProcessPoolExecutor) -> str:
    """The exit codes of the pool's dead processes, as words ("exit code 3", "killed by SIGSEGV")."""
    import signal

    words = []
    for proc in list((getattr(executor, "_processes", None) or {}).values()):
        code = proc.exitcode
        if code is None or code == 0 or code == -signal.SIGTERM:  # SIGTERM: the pool stopping the others
            continue
        try:
            words.append(f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        except ValueError:
            words.append(f"exit code {code}")
    return ", ".join(sorted(set(words)))


class VerifyBatcher:
    """Hands CPU-bound verifications to a VerifyPool in batches.

    At most `pool size + 1` submits are in flight (one per process, plus one queued so a process never
    waits for the round trip); each carries a share of what waited meanwhile, up to `max_batch`. When the
    pool is idle a batch of one goes out at once (no added latency); when it is busy, one pickle, one
    pipe round trip and one executor wake-up serve a whole batch instead of one rollout each, which
    keeps the event loop's thread (and the GIL) free for HTTP and the sink.

    A batch's rollouts all wait for its last one, so a batch is at most 1/SPREAD of a process's share of
    what waits: a burst (64 answers landing together at a 200 ms model latency) goes out in several
    batches whose results come back as each finishes, not in two halves that each wait for the slowest
    of 32; a steady backlog (a CPU-bound run) still fills batches up to `max_batch`. 3,000 tasks through
    the drop-in, 2 processes, median of 3 interleaved runs: 200 ms, 64 in flight: 12.47 s (verify_ms
    14-21) against 13.31 s (23-33) with whole batches; 0 ms: 6.84 vs 6.73 s at 64, 5.92 vs 6.27 s at 256
    (SPREAD 4 gave 12.61, 6.77 and 6.14 s)."""

    SPREAD = 2

    def __init__(self, loop: asyncio.AbstractEventLoop, processes: int | None, max_batch: int = 32,
                 pool: VerifyPool | None = None):
        self.loop = loop
        self.processes = processes
        self.max_batch = max_batch
        self.pool = pool or SHARED_VERIFY_POOL
        self.pending: deque = deque()  # (args, future, times its batch was on a crashed pool)
        self.inflight = 0
        self.isolating = False  # a suspect of a pool crash is running alone
        self._held = None  # the pool's executor, held between dispatches (no lock taken per rollout)

    def _executor(self):
        held = self._held
        if held is None or held is not self.pool._executor:  # first use, or the pool was replaced / discarded
            held = self._held = self.pool.executor(self.processes)
        return held

    def verify(self, name: str, row: dict, text: str, options: dict, fast: bool) -> asyncio.Future:
        fut = self.loop.create_future()
        self.pending.append(((name, row, text, options, fast), fut, 0))
        self._dispatch()
        return fut

    def _dispatch(self) -> None:
        executor = None
        while self.pending and not self.isolating:
            if executor is None:
                executor = self._executor()
            if self.inflight >= executor._max_workers + 1:
                return
            suspect = self.pending[0][2] > 0
            if suspect and self.inflight:  # a suspect runs alone on the pool: wait for the others to finish
                return
            batch = []
            size = min(self.max_batch, -(-len(self.pending) // (self.SPREAD * executor._max_workers)))
            while self.pending and len(batch) < size and (suspect or not self.pending[0][2]):
                args, fut, crashes = self.pending.popleft()
                if not fut.done():  # a cancelled waiter (the run is stopping) needs no verification
                    batch.append((args, fut, crashes))
                if suspect and batch:
                    break
            if not batch:
                continue
            try:
                cfut = executor.submit(*verify_call(verify_items, [args for args, _, _ in batch]))  # profiling, if on
            except Exception as exc:  # BrokenProcessPool, or a pool shut down under us
                if isinstance(exc, BrokenProcessPool):
                    self.pool.discard_broken(executor)
                    executor = None
                    self._requeue_as_suspects(batch)
                    continue
                executor = None
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.inflight += 1
            self.isolating = suspect
            afut = asyncio.wrap_future(cfut, loop=self.loop)
            afut.add_done_callback(lambda f, batch=batch, executor=executor, alone=suspect:
                                   self._done(f, batch, executor, alone))

    def _requeue_as_suspects(self, batch: list) -> None:
        """Back to the front of the queue, each to be verified alone on the pool."""
        for args, fut, crashes in reversed(batch):
            if not fut.done():
                self.pending.appendleft((args, fut, crashes + 1))

    def _done(self, afut: asyncio.Future, batch: list, executor, alone: bool = False) -> None:
        self.inflight -= 1
        if alone:
            self.isolating = False
        exc = asyncio.CancelledError() if afut.cancelled() else afut.exception()
        if isinstance(exc, BrokenProcessPool):
            # A pool process died (os._exit, a segfault, the OOM killer): every batch on the pool fails with it.
            # The rollouts of those batches are verified again, each alone on a fresh pool; one whose process dies
            # while it runs alone is the culprit and is recorded as failed. Nothing else is blamed.
            codes = _exit_codes(executor)
            self.pool.discard_broken(executor)
            if alone:
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(RemoteVerifierError(
                            VerifierCrashed.__name__,
                            f"the verifier process died while verifying this rollout ({codes or 'exit code unknown'});"
                            f" the pool was restarted and the run went on (a verifier that exits, segfaults or is "
                            f"killed for memory)"))
            else:
                log.warning("a verifier pool process died (%s); restarting the pool and verifying %d rollouts one "
                            "by one to find the one that kills it", codes or "exit code unknown", len(batch))
                self._requeue_as_suspects(batch)
            self._dispatch()
            return
        results = unwrap_result(afut.result()) if exc is None else None
        for i, (_, fut, _) in enumerate(batch):
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
        if getattr(executor, "_engine_warming", False):  # being warmed (the CLI's start): send requests meanwhile
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
