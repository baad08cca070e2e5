"""Hooks profiling into a run through the engine's own contracts: a Control wrapper (polled about once a
second in the engine's control thread) asks `source()` which profiling session should be on, switches it,
and hands finished windows to `emit` as ProfileSnapshot events; a Sink wrapper ends the session and hands
the last window over when the run closes. Both may block briefly (they run off the event loop)."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from workers.engine.types import ControlState

from .core import ProfileConfig, ProfileSnapshot, Profiler

log = logging.getLogger(__name__)


class ProfilingControl:
    def __init__(self, inner, source: Callable[[], ProfileConfig | None],
                 emit: Callable[[list[ProfileSnapshot]], None], worker: str = "", extra_sources=(), pool=None):
        self.inner = inner
        self.source = source
        self.emit = emit
        self.profiler = Profiler(worker, pool=pool)  # pool: () -> the engine's verifier ProcessPoolExecutor
        self.extra_sources = list(extra_sources)  # callables () -> list[ProfileSnapshot] (e.g. NeMo Gym /stats)
        self.finished = False
        self.lock = threading.Lock()

    def poll(self) -> ControlState:
        state = self.inner.poll() if self.inner is not None else ControlState()
        with self.lock:
            if not self.finished:
                self._switch_and_emit()
        return state

    def _switch_and_emit(self) -> None:
        try:
            self.profiler.apply(self.source())
            snaps = self.profiler.drain()
            for extra in self.extra_sources:
                snaps.extend(extra() or [])
            if snaps:
                self.emit(snaps)
        except Exception:  # noqa: BLE001  (profiling never stops a run)
            log.exception("profiling: switching or emitting failed; the run goes on")

    def finish(self) -> None:
        with self.lock:
            if self.finished:
                return
            self.finished = True
            self._finish()

    def _finish(self) -> None:
        try:
            snaps = self.profiler.finish()
            for extra in self.extra_sources:  # a source with a last pull as the run ends (nemo_gym.ServerPuller)
                if callable(last := getattr(extra, "final", None)):
                    snaps = [*(snaps or []), *(last() or [])]
            if snaps:
                self.emit(snaps)
        except Exception:  # noqa: BLE001
            log.exception("profiling: the last window could not be emitted")


class ProfilingSink:
    """Passes everything to the inner sink; on close, ends profiling first (the pool is still up)."""

    def __init__(self, inner, control: ProfilingControl):
        self.inner = inner
        self.control = control

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def rollout(self, result):
        await self.inner.rollout(result)

    async def progress(self, tick):
        await self.inner.progress(tick)

    async def close(self):
        try:
            await asyncio.to_thread(self.control.finish)
        finally:
            await self.inner.close()
