"""Profiling a running collection with yappi, switched on and off while the job runs (no restart).

Two scopes:
* "verify" (default): the verifier processes of the engine's pool. Each pool process profiles some of the
  verifications it runs (each alone, yappi started and stopped around it; the runs between them go as one
  call, as they do with profiling off), measures how much longer a profiled verification takes than an
  unprofiled one, and profiles the next one only once that extra time (and the read of the stats it hands
  back once per window) is within half of a budget (default 2 %) of all its verification time, so the
  throughput cost holds to the budget. Which verification comes next is counted in verifications, across
  batches, so that no kind of verification (e.g. the first of a batch) is favoured by the sample; never two in
  a row, so that the unprofiled time the cost is measured against stays current. A budget of 100 % profiles
  every verification (exact counts).
  Figures are scaled to all verifications (x verifications / profiled), so ncall, tsub and ttot estimate
  the whole window; tavg is not scaled (it is measured under the profiler: inflated by its overhead).
* "worker": the whole worker process (every thread: event loop, sink, control) with yappi running
  continuously, plus every verification in the pool (no sampling). Costly; for finding non-verifier work.

Wall or CPU clock (yappi's clock types). The pool processes hand their stats back with the results of a
batch (at most once per window per process) as yappi's raw entries, pickled: the rows are made and merged
in the engine process, in the control thread (`Profiler.drain()`, which returns the finished windows of
`window_s` seconds as ProfileSnapshot events for the sink), neither in the verifier processes nor on the
engine's event loop.

No Django here; `workers.engine.runner` calls `verify_call` / `unwrap_result` around its pool submits.
"""
from __future__ import annotations

from .core import (  # noqa: F401
    FuncRow, ProfileConfig, ProfileSnapshot, Profiler, active_profiler, merge_rows, rows_from_yappi, unwrap_result,
    verify_call,
)
from .control import ProfilingControl  # noqa: F401
