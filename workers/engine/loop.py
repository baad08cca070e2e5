"""The event loop a run uses: uvloop (libuv) by default where it is installed, else asyncio's own;
ENGINE_EVENT_LOOP=asyncio chooses asyncio's. At 16,384 requests in flight uvloop took 14 % less of the engine's CPU
per request and sustained the full concurrency / latency rate where asyncio's loop reached 0.92 of it
(bench/bench_scale.py inflight). One place, so the Celery task, the CLI and the simulator (SIM_EVENT_LOOP)
choose alike."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading

log = logging.getLogger(__name__)


def loop_factory(name: str | None = None):
    """A new-event-loop callable for asyncio.Runner, or None for asyncio's default."""
    name = (name if name is not None else os.environ.get("ENGINE_EVENT_LOOP", "")).strip().lower()
    if name == "asyncio":
        return None
    if name not in ("", "default", "uvloop"):
        raise ValueError(f"unknown event loop {name!r}: asyncio or uvloop")
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":  # asked for by name: say why it is not used
            log.warning("uvloop is not installed; using asyncio's event loop")
        return None
    return uvloop.new_event_loop


# Young-generation threshold while a run is on (CPython's default is 700 allocations).
RUN_GC_THRESHOLD0 = 50_000


@contextlib.contextmanager
def collector_tuned():
    """Python's cyclic garbage collector tuned for a run with thousands of requests in flight.

    Every live coroutine, future and response is a tracked object, and at the default thresholds the
    collector runs every 700 allocations and re-scans them all in its older generations: with 4,096 requests
    in flight that was a quarter of the engine's CPU. During a run, the objects that existed before it (Django,
    the verifiers' libraries) are frozen out of collection and the young generation is collected 70 times less
    often; both are undone when the last of the process's runs ends (a worker with a thread pool runs several
    at once, and the settings are the process's), so nothing that becomes garbage later is kept."""
    global _tuned_runs, _saved_threshold
    with _tuning_lock:
        if _tuned_runs == 0:
            _saved_threshold = gc.get_threshold()
            gc.freeze()
            gc.set_threshold(max(RUN_GC_THRESHOLD0, _saved_threshold[0]), *_saved_threshold[1:])
        _tuned_runs += 1
    try:
        yield
    finally:
        with _tuning_lock:
            _tuned_runs -= 1
            if _tuned_runs == 0:
                # The runs' garbage in reference cycles (a closed loop that channels_redis's bound `close` still
                # names, tasks and their owners, exceptions and their frames) would wait for a full collection,
                # which a worker's large heap makes rare: with a loop a chunk, a worker grew ~0.3 MB a chunk.
                # Collected while the heap is still frozen, only what the runs made is scanned.
                gc.collect()
                gc.set_threshold(*_saved_threshold)
                gc.unfreeze()


_tuning_lock = threading.Lock()
_tuned_runs = 0
_saved_threshold = gc.get_threshold()


def run(coro, loop: str | None = None):
    """asyncio.run(coro) on the chosen loop (`loop`, else $ENGINE_EVENT_LOOP), with the collector tuned."""
    with collector_tuned(), asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(coro)
