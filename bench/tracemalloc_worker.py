"""A Celery worker under tracemalloc, for `bench_scale workers` with BENCH_TRACEMALLOC=DIR: what in the worker grows
with the rollouts it has done. Every BENCH_TRACEMALLOC_EVERY_S seconds (default 30) a snapshot; on exit (the
bench's SIGTERM), and after each snapshot from the third on (a worker killed before it could write still leaves
one), DIR/<tag>.tracemalloc.txt gives the traced memory at each snapshot, and the allocation sites
(file:line) that grew most from the second snapshot (the run warm; BENCH_TRACEMALLOC_BASE_S: the first taken that
many seconds after the start, e.g. once the verify cache is full) to the last one taken while a chunk ran.

    python -m bench.tracemalloc_worker OUT_DIR TAG -A controlplane worker ...   # the rest: celery's arguments
"""
from __future__ import annotations

import os
import threading
import time
import tracemalloc
from pathlib import Path

from bench._common import celery_worker_reporting

_snaps: list = []  # (seconds since start, traced bytes, snapshot or None)
_lock = threading.Lock()
_t0 = time.monotonic()


def _base_index(snaps: list) -> int:
    """The snapshot growth is measured from: the second, or the first at or after BENCH_TRACEMALLOC_BASE_S."""
    base_s = float(os.environ.get("BENCH_TRACEMALLOC_BASE_S", "0"))
    return next((i for i, (t, _, _) in enumerate(snaps) if i >= 1 and t >= base_s), len(snaps) - 1)


def _sampler(every: float, out: Path, tag: str):
    while True:
        time.sleep(every)
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        with _lock:
            _snaps.append((time.monotonic() - _t0, tracemalloc.get_traced_memory()[0], snap))
            base = _base_index(_snaps)
            for i in range(len(_snaps) - 1):  # keep the base one and the last one whole
                if i != base:
                    _snaps[i] = (*_snaps[i][:2], None)
        if len(_snaps) >= 3:
            _dump(out, tag)


def _setup(out: Path, tag: str):
    tracemalloc.start(int(os.environ.get("BENCH_TRACEMALLOC_FRAMES", "1")))
    every = float(os.environ.get("BENCH_TRACEMALLOC_EVERY_S", "30"))
    threading.Thread(target=_sampler, args=(every, out, tag), daemon=True, name="tracemalloc-sampler").start()


def _dump(out: Path, tag: str):
    out.mkdir(parents=True, exist_ok=True)
    with _lock:
        snaps = list(_snaps)
    lines = ["traced MiB at each snapshot (s since start: MiB): "
             + "  ".join(f"{t:.0f}:{b / 2**20:.1f}" for t, b, _ in snaps)]
    whole = [(t, s) for t, _, s in snaps[1:] if s is not None]
    if len(whole) >= 2:
        (ta, a), (tb, b) = whole[0], whole[-1]
        lines.append(f"grown from {ta:.0f}s to {tb:.0f}s, by allocation site:")
        lines += [str(st) for st in b.compare_to(a, "lineno")[:30]]
    tmp = out / f".{tag}.tracemalloc.txt"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out / f"{tag}.tracemalloc.txt")


def main():
    import sys

    out, tag = Path(sys.argv[1]), sys.argv[2]  # celery_worker_reporting takes them off argv before setup()
    celery_worker_reporting(_dump, setup=lambda: _setup(out, tag))


if __name__ == "__main__":
    main()
