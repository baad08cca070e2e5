"""Profiling a running collection with yappi, switched on and off while the job runs (no restart).

Two scopes:
* "verify" (default): the verifier processes of the engine's pool. Each pool process profiles some of the
  verifications it runs (yappi started and stopped around one verification), measures how much longer a
  profiled verification takes than an unprofiled one, and profiles the next one only while that extra time
  (and the stats it reads once per window) is within half of a budget (default 2 %) of all its verification
  time, so the throughput cost holds to the budget.
  Figures are scaled to all verifications (x verifications / profiled), so ncall, tsub and ttot estimate
  the whole window; tavg is not scaled (it is measured under the profiler: inflated by its overhead).
* "worker": the whole worker process (every thread: event loop, sink, control) with yappi running
  continuously, plus every verification in the pool (no sampling). Costly; for finding non-verifier work.

Wall or CPU clock (yappi's clock types). The pool processes hand their rows back with the results of a
batch (at most once per FLUSH_S per process), the Profiler merges them into windows of `window_s`
seconds, and `Profiler.drain()` returns the finished windows as ProfileSnapshot events for the sink.

No Django here; `workers.engine.runner` calls `verify_call` / `unwrap_result` around its pool submits.
"""
from __future__ import annotations

from .core import (  # noqa: F401
    FuncRow, ProfileConfig, ProfileSnapshot, Profiler, active_profiler, merge_rows, rows_from_yappi, unwrap_result,
    verify_call,
)
from .control import ProfilingControl  # noqa: F401
