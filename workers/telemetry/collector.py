"""The telemetry that rides along with a run.

    telemetry = Telemetry(metrics_urls=spec.endpoint.base_urls)
    sink = TelemetrySink(db_sink, telemetry)          # any Sink
    await run_collection(spec, tasks, sink, control)

Every ProgressTick that reaches the inner sink carries `tick.extra["telemetry"]`:

    {"v": 1,
     "worker": {"cpu_main", "cpu_children", "cpu_total", "cpu_cores", "cpu_machine", "rss_mb", ...,
                "loop_lag": {"mean_ms", "p50_ms", "p99_ms", "max_ms", "n"}},
     "timing": {"n", "ok", "queue_ms": {"mean", "p50", "p99"}, "ttft_ms": {...}, "generation_ms": {...},
                "verify_ms": {...}, "wall_ms": {...}, "output_tokens": {"mean"}},   # rollouts of this interval
     "gpu": [{"index", "util", "mem_util", "mem_used_mb", "mem_total_mb", "temp_c", "name"}],  # NVML hosts only
     "vllm": {... prom.window() ..., "ok": true, "age_s"}}   # only on the tick right after a new scrape

Sampling is cheap and off the tick path: host CPU / GPU every `sample_interval_s` (in a thread), vLLM
`/metrics` every `scrape_interval_s` (async, with a timeout); the tick only copies cached values and
summarizes the interval's rollout timings. The Django DbSink stores `extra` as is.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from workers.engine.types import TIMING_FIELDS

from .host import GpuSampler, LoopLagMonitor, ProcessSampler, stop_task, summarize
from .vllm import VllmScraper



def _summary(values: list[float]) -> dict | None:
    return summarize(values, 3)


class TimingWindow:
    """Per-interval rollout timings (queue / TTFT / generation / verify / wall, output tokens).

    Cheap on the hot path: every rollout is counted, but timings are read from a systematic sample of about
    `max_samples` rollouts per interval (every k-th, k from the previous interval's rate), so the cost per
    rollout stays a counter increment at thousands of rollouts per second. Means and percentiles are over the
    sample (`sampled` says how many); `n` / `ok` are exact."""

    def __init__(self, max_samples: int = 1000):
        self.max_samples = max_samples
        self.stride = 1
        self.reset()

    def reset(self) -> None:
        self.values: dict[str, list[float]] = {f: [] for f in TIMING_FIELDS}
        self.tokens: list[float] = []
        self.n = 0
        self.ok = 0
        self.sampled = 0

    def add(self, result: Any) -> None:
        self.n += 1
        ok = getattr(result, "ok", False)
        if ok:
            self.ok += 1
        if self.n % self.stride:
            return
        self.sampled += 1
        values = self.values
        for f in TIMING_FIELDS:
            v = getattr(result, f, None)
            if v is not None:
                values[f].append(v)
        t = getattr(result, "output_tokens", None)
        if t is not None:
            self.tokens.append(t)

    def collect(self) -> dict:
        out: dict[str, Any] = {"n": self.n, "ok": self.ok, "sampled": self.sampled}
        for f in TIMING_FIELDS:
            s = _summary(self.values[f])
            if s is not None:
                out[f] = s
        if self.tokens:
            out["output_tokens"] = {"mean": round(sum(self.tokens) / len(self.tokens), 2)}
        self.stride = max(1, self.n // self.max_samples)
        self.reset()
        return out


class Telemetry:
    """Host, GPU and vLLM telemetry with background sampling. Start it inside the event loop of the run
    (TelemetrySink does so lazily); `payload()` returns the tick's telemetry dict without blocking."""

    def __init__(self, metrics_urls: list[str] | str | None = None, scrape_interval_s: float = 5.0,
                 sample_interval_s: float = 2.0, loop_lag_interval_s: float = 0.1, scrape_timeout_s: float = 2.0,
                 gpu: bool = True, host: bool = True, loop_lag: bool = True):
        self.scrape_interval_s = scrape_interval_s
        self.sample_interval_s = sample_interval_s
        self.scraper = VllmScraper(metrics_urls, timeout_s=scrape_timeout_s) if metrics_urls else None
        self.process = ProcessSampler() if host else None
        self.gpu = GpuSampler() if gpu else None
        self.loop_lag = LoopLagMonitor(loop_lag_interval_s) if loop_lag else None
        self._task: asyncio.Task | None = None
        self._host: dict | None = None
        self._gpu: list | None = None
        self._vllm: dict | None = None
        self._vllm_t = 0.0
        self._vllm_fresh = False
        self.latest_vllm: dict | None = None  # the last successful scrape (for the adaptive controller)
        self.latest_vllm_t = 0.0  # its time.monotonic()
        self.started = False

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.loop_lag is not None:
            self.loop_lag.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="telemetry-sampler")

    async def stop(self) -> None:
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        self._task = await stop_task(self._task)
        if self.scraper is not None:
            await self.scraper.close()
        if self.gpu is not None:
            self.gpu.close()
        self.started = False

    def _sample_host(self) -> tuple[dict | None, list | None]:
        host = self.process.sample() if self.process is not None else None
        gpu = self.gpu.sample() if self.gpu is not None else None
        return host, gpu

    async def _run(self) -> None:
        next_scrape = 0.0
        next_sample = 0.0
        while True:
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + self.sample_interval_s
                try:
                    self._host, self._gpu = await asyncio.to_thread(self._sample_host)
                except Exception:
                    pass
            if self.scraper is not None and self.scraper.supported and now >= next_scrape:
                next_scrape = now + self.scrape_interval_s
                try:
                    result = await self.scraper.scrape()
                except Exception as e:  # never let telemetry take the run down
                    result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self._vllm, self._vllm_t, self._vllm_fresh = result, time.monotonic(), True
                if result.get("ok"):
                    self.latest_vllm, self.latest_vllm_t = result, self._vllm_t
            scraping = self.scraper is not None and self.scraper.supported
            await asyncio.sleep(max(0.05, min(next_sample, next_scrape if scraping else next_sample) - time.monotonic()))

    # ------------------------------------------------------------------------------------ payload
    def payload(self) -> dict:
        out: dict[str, Any] = {"v": 1}
        worker: dict[str, Any] = dict(self._host) if self._host else {}
        if self.loop_lag is not None:
            lag = self.loop_lag.collect()
            if lag is not None:
                worker["loop_lag"] = lag
        if worker:
            out["worker"] = worker
        if self._gpu:
            out["gpu"] = self._gpu
        if self._vllm is not None and self._vllm_fresh:
            self._vllm_fresh = False
            v = dict(self._vllm)
            v["age_s"] = round(time.monotonic() - self._vllm_t, 3)
            out["vllm"] = v
        return out


class TelemetrySink:
    """A Sink wrapper: passes everything to `inner`, and adds `extra["telemetry"]` to each ProgressTick.
    Keeps the last `history` ticks (as plain dicts) for Django-free diagnosis (`workers.diagnosis`)."""

    def __init__(self, inner: Any = None, telemetry: Telemetry | None = None, history: int = 3600, **telemetry_kwargs):
        self.inner = inner
        self.telemetry = telemetry if telemetry is not None else Telemetry(**telemetry_kwargs)
        self.timing = TimingWindow()
        self.history: collections.deque = collections.deque(maxlen=history)

    async def rollout(self, result) -> None:
        if not self.telemetry.started:
            self.telemetry.start()
        self.timing.add(result)
        if self.inner is not None:
            await self.inner.rollout(result)

    async def progress(self, tick) -> None:
        if not self.telemetry.started:
            self.telemetry.start()
        payload = self.telemetry.payload()
        payload["timing"] = self.timing.collect()
        tick.extra["telemetry"] = payload
        self.history.append(tick_to_dict(tick))
        if self.inner is not None:
            await self.inner.progress(tick)

    async def close(self) -> None:
        await self.telemetry.stop()
        if self.inner is not None:
            await self.inner.close()


def tick_to_dict(tick: Any) -> dict:
    """A ProgressTick as the plain dict shape a JobMetricSample row also converts to."""
    return {
        "elapsed_s": tick.elapsed_s,
        "completed": tick.completed,
        "failed": tick.failed,
        "in_flight": tick.in_flight,
        "parallelism": tick.parallelism,
        "samples_per_s": tick.samples_per_s,
        "output_tokens_per_s": tick.output_tokens_per_s,
        "errors": dict(tick.errors or {}),
        "extra": tick.extra,
    }
