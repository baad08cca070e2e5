"""vLLM's Prometheus `/metrics`, parsed into a snapshot; two snapshots give a window.

A `VllmSnapshot` holds the numbers that reveal bottlenecks, summed over label sets (engines of a
data-parallel server, replicas): gauges (running / waiting requests, KV-cache usage), counters
(preemptions, prompt / generation tokens, finished requests) and cumulative histograms (TTFT, inter-token
latency, end-to-end latency, queue time). Old and new metric names are read alike (VLLM.md):

    KV-cache usage      vllm:kv_cache_usage_perc            (old: vllm:gpu_cache_usage_perc)
    inter-token latency vllm:inter_token_latency_seconds    (old: vllm:time_per_output_token_seconds)

Percentiles are never read from a single scrape (a histogram is cumulative since the server started): they
come from the BUCKET DELTAS between two scrapes (`window(prev, cur)`), i.e. the requests that finished in
between, with Prometheus' `histogram_quantile` linear interpolation inside a bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

# Logical name -> metric names to try, newest first. Counters are listed without `_total`.
GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "swapped": ("vllm:num_requests_swapped",),  # V0 only
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTERS = {
    "preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "vllm:request_time_per_output_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "generation_len": ("vllm:request_generation_tokens",),
}
# Gauges where a sum over engines makes no sense (a fraction): take the max.
_MAX_GAUGES = {"kv_usage"}
QUANTILES = (0.5, 0.9, 0.99)


@dataclass
class Histogram:
    """A cumulative histogram: sorted finite upper bounds, cumulative counts per bound, +Inf count, sum."""

    bounds: list[float] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    count: float = 0.0  # the +Inf bucket (== _count)
    sum: float = 0.0

    def delta(self, prev: "Histogram | None") -> "Histogram":
        """The histogram of observations between `prev` and this one. A counter reset (server restart,
        or different buckets) gives this histogram itself."""
        if prev is None or prev.bounds != self.bounds or self.count < prev.count or any(
            c < p for c, p in zip(self.cumulative, prev.cumulative)
        ):
            return Histogram(list(self.bounds), list(self.cumulative), self.count, self.sum)
        return Histogram(
            list(self.bounds),
            [c - p for c, p in zip(self.cumulative, prev.cumulative)],
            self.count - prev.count,
            self.sum - prev.sum,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q*count.
        None when empty; the highest finite bound when the rank falls in the +Inf bucket."""
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.cumulative):
            if cum >= rank:
                if cum == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (cum - lower_count)
            lower_bound, lower_count = bound, cum
        return self.bounds[-1]

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class VllmSnapshot:
    """One scrape (or the sum of several replicas' scrapes). Missing metrics are absent from the dicts."""

    t: float = 0.0  # monotonic time of the scrape
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    names_seen: dict[str, str] = field(default_factory=dict)  # logical name -> the metric name found
    info: dict[str, dict[str, str]] = field(default_factory=dict)  # e.g. cache_config_info labels
    capacity: dict[str, float] = field(default_factory=dict)  # what the server says it can hold (see capacity_of)
    finished: dict[str, float] = field(default_factory=dict)  # request_success_total by finished_reason

    @property
    def flavor(self) -> str:
        """'new' / 'old' naming (by the KV-cache gauge), or '' when no vLLM metrics were found."""
        kv = self.names_seen.get("kv_usage")
        if kv == "vllm:kv_cache_usage_perc":
            return "new"
        if kv == "vllm:gpu_cache_usage_perc":
            return "old"
        return "new" if self.names_seen else ""


def _merge_hist(a: Histogram | None, b: Histogram) -> Histogram:
    if a is None:
        return b
    if a.bounds != b.bounds:  # different bucket layouts cannot be summed: keep the bigger one
        return a if a.count >= b.count else b
    return Histogram(a.bounds, [x + y for x, y in zip(a.cumulative, b.cumulative)], a.count + b.count, a.sum + b.sum)


def parse_metrics(text: str, t: float = 0.0) -> VllmSnapshot:
    """Parse Prometheus text exposition into a VllmSnapshot (unknown metrics are ignored).
    Raises ValueError on text that is not Prometheus exposition."""
    # name -> list of (labels, value) samples, keyed by sample name
    samples: dict[str, list[tuple[dict, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
    except Exception as e:  # the parser raises ValueError / IndexError on garbage
        raise ValueError(f"not Prometheus text: {e}") from None
    snap = VllmSnapshot(t=t)

    for key, names in GAUGES.items():
        for name in names:
            if name in samples:
                vals = [v for _, v in samples[name] if not math.isnan(v)]
                if vals:
                    snap.gauges[key] = max(vals) if key in _MAX_GAUGES else sum(vals)
                    snap.names_seen[key] = name
                break
    for key, names in COUNTERS.items():
        for name in names:
            for sample_name in (name + "_total", name):
                if sample_name in samples:
                    snap.counters[key] = sum(v for _, v in samples[sample_name] if not math.isnan(v))
                    snap.names_seen[key] = name
                    break
            if key in snap.counters:
                break
    for key, names in HISTOGRAMS.items():
        for name in names:
            bucket_samples = samples.get(name + "_bucket")
            if not bucket_samples:
                continue
            # group by the label set without `le`
            groups: dict[tuple, dict[float, float]] = {}
            for labels, value in bucket_samples:
                le = labels.get("le")
                if le is None:
                    continue
                group = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
                groups.setdefault(group, {})[float(le)] = value
            sums = {tuple(sorted(lbl.items())): v for lbl, v in samples.get(name + "_sum", [])}
            merged: Histogram | None = None
            for group, buckets in groups.items():
                finite = sorted(b for b in buckets if not math.isinf(b))
                total = buckets.get(math.inf, buckets[finite[-1]] if finite else 0.0)
                h = Histogram(finite, [buckets[b] for b in finite], total, sums.get(group, 0.0))
                merged = _merge_hist(merged, h)
            if merged is not None:
                snap.histograms[key] = merged
                snap.names_seen[key] = name
                break
    for name in ("vllm:cache_config_info",):
        if name in samples and samples[name]:
            snap.info["cache_config"] = dict(samples[name][0][0])
            snap.capacity = capacity_of([labels for labels, _ in samples[name]])
    for labels, value in samples.get("vllm:request_success_total", samples.get("vllm:request_success", [])):
        reason = labels.get("finished_reason") or "?"
        if not math.isnan(value):
            snap.finished[reason] = snap.finished.get(reason, 0.0) + value
    return snap


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def capacity_of(cache_configs: list[dict]) -> dict[str, float]:
    """What a server states about its capacity, from `vllm:cache_config_info` labels (one label set per
    engine), summed over engines:
      kv_cache_max_concurrency  requests of max_model_len tokens the KV cache holds at once
      kv_cache_size_tokens      KV-cache size in tokens
      num_gpu_blocks, block_size
      max_model_len             kv_cache_size_tokens / kv_cache_max_concurrency (vLLM 0.32 does not label it)
      max_num_seqs              only when the server labels it (vLLM does not; the simulator does not either)
      gpu_memory_utilization    the setting (not summed)
    """
    out: dict[str, float] = {}
    for cfg in cache_configs:
        for key in ("kv_cache_max_concurrency", "kv_cache_size_tokens", "num_gpu_blocks", "max_num_seqs"):
            v = _num(cfg.get(key))
            if v is not None:
                out[key] = out.get(key, 0.0) + v
        for key in ("gpu_memory_utilization", "block_size", "max_model_len"):
            v = _num(cfg.get(key))
            if v is not None:
                out[key] = v
        tokens, conc = _num(cfg.get("kv_cache_size_tokens")), _num(cfg.get("kv_cache_max_concurrency"))
        if "max_model_len" not in out and tokens and conc:
            out["max_model_len"] = float(round(tokens / conc))
    if out:
        out["engines"] = float(len(cache_configs))
    return out


def merge_snapshots(snaps: Iterable[VllmSnapshot]) -> VllmSnapshot:
    """Sum replicas' snapshots into one (gauges summed, KV usage max, histograms summed)."""
    out = VllmSnapshot()
    for s in snaps:
        out.t = max(out.t, s.t)
        for k, v in s.gauges.items():
            out.gauges[k] = max(out.gauges.get(k, v), v) if k in _MAX_GAUGES else out.gauges.get(k, 0.0) + v
        for k, v in s.counters.items():
            out.counters[k] = out.counters.get(k, 0.0) + v
        for k, h in s.histograms.items():
            out.histograms[k] = _merge_hist(out.histograms.get(k), h)
        out.names_seen.update(s.names_seen)
        out.info.update(s.info)
        for k, v in s.capacity.items():  # replicas add up; settings stay settings
            out.capacity[k] = v if k in ("gpu_memory_utilization", "block_size", "max_model_len") else out.capacity.get(k, 0.0) + v
        for k, v in s.finished.items():
            out.finished[k] = out.finished.get(k, 0.0) + v
    return out


def window(prev: VllmSnapshot | None, cur: VllmSnapshot) -> dict:
    """What happened between two scrapes, as a JSON-friendly dict: the current gauges, counter rates
    (per second) and deltas, and p50/p90/p99 + mean + count of each histogram from bucket deltas.
    With no previous scrape, rates are absent and percentiles cover the server's whole life."""
    out: dict = {
        "running": cur.gauges.get("running"),
        "waiting": cur.gauges.get("waiting"),
        "kv_usage": cur.gauges.get("kv_usage"),
        "names": cur.flavor,
    }
    if "swapped" in cur.gauges:
        out["swapped"] = cur.gauges["swapped"]
    dt = (cur.t - prev.t) if prev is not None else 0.0
    out["window_s"] = round(dt, 3) if prev is not None else None
    for key, value in cur.counters.items():
        out[f"{key}_total"] = value
        if prev is not None and key in prev.counters and dt > 0:
            delta = value - prev.counters[key]
            if delta < 0:  # counter reset: the server restarted
                delta = value
            out[f"{key}_delta"] = delta
            out[f"{key}_per_s"] = round(delta / dt, 4)
    for key, hist in cur.histograms.items():
        d = hist.delta(prev.histograms.get(key) if prev is not None else None)
        entry: dict = {"count": d.count}
        if d.count > 0:
            entry["mean"] = d.mean
            for q in QUANTILES:
                entry[f"p{int(q * 100)}"] = d.quantile(q)
        out[key] = entry
    if cur.capacity:
        out["capacity"] = dict(cur.capacity)
    if prev is not None and cur.finished and dt > 0:
        delta = {k: v - prev.finished.get(k, 0.0) for k, v in cur.finished.items()}
        if all(v >= 0 for v in delta.values()):
            out["finished_delta"] = {k: v for k, v in delta.items() if v}
    if "cache_config" in cur.info:
        cfg = cur.info["cache_config"]
        out["cache_config"] = {k: cfg[k] for k in ("num_gpu_blocks", "block_size", "gpu_memory_utilization", "kv_cache_max_concurrency", "kv_cache_size_tokens", "max_num_seqs", "max_model_len") if k in cfg}
    return out
