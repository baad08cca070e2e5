"""What other apps add to a chunk run, registered from their AppConfig.ready(): the jobs app imports no
feature app (profiling, diagnostics, monitoring sit above it), in the way the engine's sources.py lets
NeMo Gym add rollout sources.

A run wrapper is `wrapper(job, sink, control, *, db, worker_name) -> (sink, control)`; they apply in the
order of RUN_WRAPPERS, after the built-in instrumentation, and must never raise (a problem leaves the run
as it was)."""
from __future__ import annotations

from typing import Callable

RunWrapper = Callable[..., tuple]

RUN_WRAPPERS: list[tuple[str, RunWrapper]] = []


def register_run_wrapper(name: str, wrapper: RunWrapper) -> None:
    """Add (or replace, by name) a wrapper; a replaced one keeps its place in the order."""
    for i, (existing, _) in enumerate(RUN_WRAPPERS):
        if existing == name:
            RUN_WRAPPERS[i] = (name, wrapper)
            return
    RUN_WRAPPERS.append((name, wrapper))


def wrap_run(job, sink, control, *, db, worker_name: str = ""):
    for _, wrapper in RUN_WRAPPERS:
        sink, control = wrapper(job, sink, control, db=db, worker_name=worker_name)
    return sink, control
