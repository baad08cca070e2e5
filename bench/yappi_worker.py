"""A Celery worker under yappi, for `bench_scale workers --profile DIR`: every thread (the task's engine thread,
its DB thread), on the CPU clock, or the wall clock with BENCH_YAPPI_CLOCK=wall. On exit (the bench's SIGTERM:
Celery's warm shutdown) it writes DIR/<tag>.pstats (open with pstats / snakeviz) and DIR/<tag>.txt (the top
functions by own and by total time, and each thread's time). yappi slows the worker down several times: read
the shares, not the rates.

    python -m bench.yappi_worker OUT_DIR TAG -A controlplane worker ...   # the rest: celery's arguments
"""
from __future__ import annotations

import io
import os
import pstats
from pathlib import Path

from bench._common import celery_worker_reporting


def _dump(out: Path, tag: str):
    import yappi

    yappi.stop()
    out.mkdir(parents=True, exist_ok=True)
    stats = yappi.get_func_stats()
    stats.save(str(out / f"{tag}.pstats"), type="pstat")
    text = io.StringIO()
    for key in ("tottime", "cumtime"):
        text.write(f"--- top 60 by {key} ({yappi.get_clock_type()} clock, all threads) ---\n")
        pstats.Stats(str(out / f"{tag}.pstats"), stream=text).sort_stats(key).print_stats(60)
    text.write("--- threads (s) ---\n")
    for t in yappi.get_thread_stats():
        text.write(f"{t.name:30s} {t.ttot:8.2f} s  {t.sched_count} switches\n")
    (out / f"{tag}.txt").write_text(text.getvalue())


def _start():
    import yappi

    yappi.set_clock_type(os.environ.get("BENCH_YAPPI_CLOCK", "cpu"))  # "wall": where a chunk's time goes
    yappi.start(builtins=False, profile_threads=True)


def main():
    celery_worker_reporting(_dump, setup=_start)


if __name__ == "__main__":
    main()
