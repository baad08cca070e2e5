"""The event loop a run uses: asyncio's own, or uvloop (libuv; roughly halves the per-request CPU of the
HTTP client and server at thousands of requests in flight) when ENGINE_EVENT_LOOP=uvloop and it is
installed. One place, so the Celery task, the CLI and the simulator (SIM_EVENT_LOOP) choose alike."""
from __future__ import annotations

import asyncio
import logging
import os

log = logging.getLogger(__name__)


def loop_factory(name: str | None = None):
    """A new-event-loop callable for asyncio.Runner, or None for asyncio's default."""
    name = (name if name is not None else os.environ.get("ENGINE_EVENT_LOOP", "asyncio")).strip().lower()
    if name in ("", "asyncio", "default"):
        return None
    if name != "uvloop":
        raise ValueError(f"unknown event loop {name!r}: asyncio or uvloop")
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed; using asyncio's event loop")
        return None
    return uvloop.new_event_loop


def run(coro, loop: str | None = None):
    """asyncio.run(coro) on the chosen loop (`loop`, else $ENGINE_EVENT_LOOP)."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(coro)
