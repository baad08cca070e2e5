"""Worker-side telemetry: CPU and memory of this process and its children (the verification pool),
event-loop lag, and GPUs through NVML. Everything degrades to None / [] instead of raising.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from workers.engine.aggregate import quantile


def summarize(values: list[float], digits: int, suffix: str = "") -> dict | None:
    """mean, p50 and p99 (nearest rank) of `values` (sorted in place), rounded; None when there are none."""
    if not values:
        return None
    values.sort()
    return {f"mean{suffix}": round(sum(values) / len(values), digits),
            f"p50{suffix}": round(quantile(values, 0.5, "nearest"), digits),
            f"p99{suffix}": round(quantile(values, 0.99, "nearest"), digits)}

try:
    import psutil
except Exception:  # pragma: no cover - psutil is a pinned dependency
    psutil = None


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a sampler's task and wait for it to end, whatever it raised on the way out. Returns None, for
    `self._task = await stop_task(self._task)`."""
    if task is not None:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
    return None

class ProcessSampler:
    """CPU of this process and of its children (a ProcessPoolExecutor's workers), and RSS.

    `sample()` returns CPU percentages since the previous call, in "percent of one core" (100 = one core
    busy), like `top`: `cpu_main` is the event-loop process, `cpu_children` the sum over child processes
    (verification pool), `cpu_total` both. `cpu_cores` is how many cores the machine has, and
    `cpu_machine` the machine-wide utilization (0..100) to spot contention from other processes.
    """

    def __init__(self, pid: int | None = None):
        self.available = psutil is not None
        self._proc = psutil.Process(pid or os.getpid()) if self.available else None
        self._children: dict[int, Any] = {}
        self.cores = (psutil.cpu_count() or 1) if self.available else (os.cpu_count() or 1)
        if self.available:
            self._proc.cpu_percent(None)
            psutil.cpu_percent(None)

    def sample(self) -> dict | None:
        if not self.available:
            return None
        try:
            main = self._proc.cpu_percent(None)
            rss = self._proc.memory_info().rss
            children_cpu = 0.0
            children_rss = 0
            seen = set()
            for child in self._proc.children(recursive=True):
                seen.add(child.pid)
                known = self._children.get(child.pid)
                try:
                    if known is None:
                        self._children[child.pid] = child
                        child.cpu_percent(None)  # first call primes the counter
                        continue
                    children_cpu += known.cpu_percent(None)
                    children_rss += known.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            for pid in list(self._children):
                if pid not in seen:
                    del self._children[pid]
            return {
                "cpu_main": round(main, 1),
                "cpu_children": round(children_cpu, 1),
                "cpu_total": round(main + children_cpu, 1),
                "cpu_cores": self.cores,
                "cpu_machine": round(psutil.cpu_percent(None), 1),
                "children": len(seen),
                "rss_mb": round(rss / 2**20, 1),
                "children_rss_mb": round(children_rss / 2**20, 1),
            }
        except Exception:
            return None


class LoopLagMonitor:
    """Event-loop lag: a periodic asyncio timer that sleeps `interval_s` and records how late it woke up.
    A loop that is blocked (a slow sink, CPU work on the loop) shows up as lag. `collect()` returns the
    window since the previous call and starts a new one."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._lags: list[float] = []
        self._max_total = 0.0

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="telemetry-loop-lag")

    async def stop(self) -> None:
        self._task = await stop_task(self._task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.interval_s)
            lag = max(0.0, loop.time() - t0 - self.interval_s)
            self._lags.append(lag * 1000.0)
            if len(self._lags) > 10000:  # nobody collects: keep memory bounded
                del self._lags[:5000]

    def collect(self) -> dict | None:
        lags, self._lags = self._lags, []
        out = summarize(lags, 2, "_ms")
        if out is not None:
            out.update(max_ms=round(lags[-1], 2), n=len(lags))
        return out


class GpuSampler:
    """Utilization and memory per GPU through NVML (nvidia-ml-py). On a host without an NVIDIA driver,
    `available` is False and `sample()` returns None: never raises."""

    def __init__(self):
        self.available = False
        self._nvml = None
        self._handles: list = []
        self.error = ""
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            self.available = count > 0
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.error = f"{type(e).__name__}: {e}"

    def sample(self) -> list[dict] | None:
        if not self.available:
            return None
        nv = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            entry: dict[str, Any] = {"index": i}
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h)
                entry["util"] = float(util.gpu)
                entry["mem_util"] = float(util.memory)
            except Exception:
                pass
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                entry["mem_used_mb"] = round(mem.used / 2**20, 1)
                entry["mem_total_mb"] = round(mem.total / 2**20, 1)
            except Exception:
                pass
            try:
                entry["temp_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            except Exception:
                pass
            try:
                name = nv.nvmlDeviceGetName(h)
                entry["name"] = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:
                pass
            out.append(entry)
        return out

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self.available = False


def now() -> float:
    return time.monotonic()
