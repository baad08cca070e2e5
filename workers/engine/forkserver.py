"""The verifier pool's process start method: a fork server (never plain fork: the engine often runs in a thread
of a threaded process) that imports the verifiers and math-verify once, and runs the math verifier once
(pool_preload), before it forks any pool process. Light to import: the collection command starts the server
first thing, so its ~0.6 s of imports run on another core while the command imports and sets up Django."""
from __future__ import annotations

import multiprocessing

PRELOAD = ["workers.verifiers", "math_verify", "workers.engine.pool_preload"]


def context():
    """The start method's context: forkserver where available (preloading PRELOAD), else spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def start() -> None:
    """Start the fork server now (it is otherwise started by the pool's first process)."""
    if context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
