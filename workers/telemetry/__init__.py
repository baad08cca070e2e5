"""Telemetry that rides along with a collection run (no Django here).

- `TelemetrySink(inner_sink, Telemetry(metrics_urls=...))`: adds `extra["telemetry"]` to every ProgressTick
  (worker CPU / RSS / event-loop lag, the interval's rollout timing breakdown, GPUs via NVML, vLLM /metrics).
- `parse_metrics(text)` / `window(prev, cur)`: vLLM Prometheus text -> gauges, counter rates and bucket-delta
  percentiles, old and new metric names alike.
"""
from .collector import Telemetry, TelemetrySink, TimingWindow, tick_to_dict  # noqa: F401
from .host import GpuSampler, LoopLagMonitor, ProcessSampler  # noqa: F401
from .prom import Histogram, VllmSnapshot, merge_snapshots, parse_metrics, window  # noqa: F401
from .vllm import VllmScraper, metrics_url  # noqa: F401
