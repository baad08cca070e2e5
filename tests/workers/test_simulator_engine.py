"""Capacity and queueing, /metrics that move with load, KV preemption, and the RL/admin routes."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

BODY = {"messages": [{"role": "user", "content": "Write something."}], "max_tokens": 1}


def scrape(sim) -> dict:
    """{(sample name, frozenset(labels minus model/engine)): value} from the simulator's /metrics."""
    out = {}
    for fam in text_string_to_metric_families(sim.metrics_text()):
        for smp in fam.samples:
            labels = {k: v for k, v in smp.labels.items() if k not in ("model_name", "engine")}
            out[(smp.name, frozenset(labels.items()))] = smp.value
    return out


def val(m, name, **labels):
    return m[(name, frozenset(labels.items()))]


async def chat(s, sim, body=None, headers=None):
    async with s.post(sim.base_url + "/chat/completions", json=body or BODY, headers=headers or {}) as r:
        return r.status, await r.json(), r.headers


@pytest.mark.slow
async def test_throughput_at_twice_capacity_is_capacity_over_latency(simulator_factory):
    cap, latency_s, n = 4, 0.1, 24
    sim = simulator_factory(ttft_ms=latency_s * 1000, itl_ms=0, jitter=0, max_num_seqs=cap)
    async with aiohttp.ClientSession() as s:
        await chat(s, sim)  # warm the connection pool and the server
        sem = asyncio.Semaphore(2 * cap)

        async def one():
            async with sem:
                st, data, _ = await chat(s, sim)
                assert st == 200

        t0 = time.perf_counter()
        await asyncio.gather(*[one() for _ in range(n)])
        elapsed = time.perf_counter() - t0
    rate = n / elapsed
    expected = cap / latency_s  # 40 req/s: concurrency beyond capacity only queues
    assert 0.6 * expected <= rate <= 1.05 * expected, (rate, expected)
    m = scrape(sim)
    # half of the requests at any time waited a full latency in the queue
    assert val(m, "vllm:request_queue_time_seconds_count") == n + 1
    assert val(m, "vllm:request_queue_time_seconds_sum") >= 0.5 * (n / 2) * latency_s


async def test_metrics_names_present(simulator):
    m = scrape(simulator)
    names = {k[0] for k in m}
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum"]:
        assert name in names, name
    text = simulator.metrics_text()
    assert f'model_name="{simulator.model}"' in text and 'engine="0"' in text
    assert 'vllm:request_success_total{engine="0",model_name="sim-model",finished_reason="stop"}' in text


@pytest.mark.slow
async def test_metrics_move_under_load(simulator_factory):
    sim = simulator_factory(ttft_ms=400, itl_ms=0, jitter=0, max_num_seqs=4, kv_cache_tokens=1000)
    before = scrape(sim)
    assert val(before, "vllm:num_requests_running") == 0
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "Count to ten for me."}], "max_tokens": 5}
        tasks = [asyncio.create_task(chat(s, sim, body)) for _ in range(6)]
        await asyncio.sleep(0.2)
        during = await asyncio.to_thread(scrape, sim)
        results = await asyncio.gather(*tasks)
    assert all(st == 200 for st, _, _ in results)
    assert val(during, "vllm:num_requests_running") == 4
    assert val(during, "vllm:num_requests_waiting") == 2
    assert val(during, "vllm:num_requests_waiting_by_reason", reason="capacity") == 2
    prompt = results[0][1]["usage"]["prompt_tokens"]
    assert val(during, "vllm:kv_cache_usage_perc") == pytest.approx(4 * prompt / 1000)
    after = scrape(sim)
    assert val(after, "vllm:num_requests_running") == 0 and val(after, "vllm:num_requests_waiting") == 0
    assert val(after, "vllm:kv_cache_usage_perc") == 0
    assert val(after, "vllm:prompt_tokens_total") == 6 * prompt
    assert val(after, "vllm:generation_tokens_total") == 6 * 5
    assert val(after, "vllm:request_success_total", finished_reason="stop") == 6
    assert val(after, "vllm:time_to_first_token_seconds_count") == 6
    assert val(after, "vllm:time_to_first_token_seconds_sum") >= 6 * 0.4 * 0.95 + 2 * 0.4 * 0.9  # two queued
    assert val(after, "vllm:inter_token_latency_seconds_count") == 6 * 4
    assert val(after, "vllm:e2e_request_latency_seconds_count") == 6
    # identical prompts: the prefix cache is queried for every prompt token, later ones hit
    assert val(after, "vllm:prefix_cache_queries_total") == 6 * prompt
    assert val(after, "vllm:prefix_cache_hits_total") > 0


async def test_kv_overflow_preempts_and_still_completes(simulator_factory):
    sim = simulator_factory(ttft_ms=5, itl_ms=2, jitter=0, max_num_seqs=4, kv_cache_tokens=120)
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "Go."}], "max_tokens": 40}
        results = await asyncio.gather(*[chat(s, sim, body) for _ in range(4)])
    assert all(st == 200 and d["usage"]["completion_tokens"] == 40 for st, d, _ in results)
    m = scrape(sim)
    assert val(m, "vllm:num_preemptions_total") > 0
    assert val(m, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.slow
async def test_load_factor_slows_under_load(simulator_factory):
    sim = simulator_factory(ttft_ms=50, itl_ms=0, jitter=0, max_num_seqs=8, load_factor=3.0)
    async with aiohttp.ClientSession() as s:
        await chat(s, sim)
        t0 = time.perf_counter()
        await chat(s, sim)
        alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*[chat(s, sim) for _ in range(8)])
        loaded = time.perf_counter() - t0
    # alone: 50 ms * (1 + 3 * 1/8) ~ 69 ms; with 8 running the last admitted sees 50 ms * (1 + 3) = 200 ms
    assert loaded >= 0.19
    assert alone < loaded / 1.8


async def test_update_weights_bumps_version_and_takes_time(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, update_weights_ms=150)
    async with aiohttp.ClientSession() as s:
        st, data, hdrs = await chat(s, sim)
        assert hdrs["X-Weight-Version"] == "0" and data["weight_version"] == 0
        t0 = time.perf_counter()
        async with s.post(sim.url + "/update_weights") as r:
            res = await r.json()
        took = time.perf_counter() - t0
        assert res["weight_version"] == 1 and took >= 0.14
        st, data, hdrs = await chat(s, sim)
        assert hdrs["X-Weight-Version"] == "1" and data["weight_version"] == 1
        async with s.post(sim.url + "/update_weights", json={"duration_ms": 0, "weight_version": 42}) as r:
            assert (await r.json())["weight_version"] == 42
        async with s.get(sim.url + "/weight_version") as r:
            assert (await r.json())["weight_version"] == 42
        async with s.post(sim.base_url + "/responses", json={"input": "hello", "max_output_tokens": 2}) as r:
            assert (await r.json())["metadata"]["weight_version"] == "42"


@pytest.mark.slow
async def test_pause_keep_holds_and_resume_releases(simulator_factory):
    sim = simulator_factory(ttft_ms=50, itl_ms=0, jitter=0)
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/pause", params={"mode": "keep"}) as r:
            assert r.status == 200
        async with s.get(sim.url + "/is_paused") as r:
            assert (await r.json())["is_paused"] is True
        task = asyncio.create_task(chat(s, sim))
        await asyncio.sleep(0.3)
        assert not task.done()  # held while paused
        assert val(await asyncio.to_thread(scrape, sim), "vllm:num_requests_waiting") == 1
        async with s.post(sim.url + "/resume") as r:
            assert r.status == 200
        st, data, _ = await asyncio.wait_for(task, 5)
        assert st == 200 and data["choices"][0]["finish_reason"] == "stop"
        async with s.get(sim.url + "/is_paused") as r:
            assert (await r.json())["is_paused"] is False


@pytest.mark.slow
async def test_pause_keep_freezes_in_flight_generation(simulator_factory):
    sim = simulator_factory(ttft_ms=10, itl_ms=20, jitter=0)
    async with aiohttp.ClientSession() as s:
        body = {"messages": BODY["messages"], "max_tokens": 20}  # ~400 ms unpaused
        t0 = time.perf_counter()
        task = asyncio.create_task(chat(s, sim, body))
        await asyncio.sleep(0.08)
        async with s.post(sim.url + "/pause", params={"mode": "keep"}):
            pass
        await asyncio.sleep(0.4)
        assert not task.done()
        async with s.post(sim.url + "/resume"):
            pass
        st, data, _ = await asyncio.wait_for(task, 5)
    assert st == 200 and data["usage"]["completion_tokens"] == 20
    assert time.perf_counter() - t0 >= 0.75  # ~400 ms of generation + the ~400 ms freeze


@pytest.mark.slow
async def test_pause_abort_aborts_in_flight(simulator_factory):
    sim = simulator_factory(ttft_ms=10, itl_ms=50, jitter=0)
    async with aiohttp.ClientSession() as s:
        body = {"messages": BODY["messages"], "max_tokens": 100, "stream": False}
        task = asyncio.create_task(chat(s, sim, body))
        await asyncio.sleep(0.2)
        async with s.post(sim.url + "/pause", params={"mode": "abort"}) as r:
            assert r.status == 200
        st, data, _ = await asyncio.wait_for(task, 5)
        assert st == 200
        assert data["choices"][0]["finish_reason"] == "abort"
        assert 0 < data["usage"]["completion_tokens"] < 100
        async with s.post(sim.url + "/resume"):
            pass
    assert val(scrape(sim), "vllm:request_success_total", finished_reason="abort") == 1


@pytest.mark.slow
async def test_pause_wait_returns_after_in_flight_finish(simulator_factory):
    sim = simulator_factory(ttft_ms=400, itl_ms=0, jitter=0)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(chat(s, sim))
        await asyncio.sleep(0.05)
        assert not task.done()
        async with s.post(sim.url + "/pause", params={"mode": "wait"}) as r:
            assert r.status == 200
            res = await r.json()
        assert res["wait_ms"] >= 50  # /pause held until the in-flight request finished
        st, data, _ = await asyncio.wait_for(task, 5)
        assert st == 200 and data["choices"][0]["finish_reason"] == "stop"
        # new requests are held while paused
        held = asyncio.create_task(chat(s, sim))
        await asyncio.sleep(0.6)
        assert not held.done()
        async with s.post(sim.url + "/pause", params={"mode": "bogus"}) as r:
            assert r.status == 400
        async with s.post(sim.url + "/resume"):
            pass
        st, _, _ = await asyncio.wait_for(held, 5)
        assert st == 200


@pytest.mark.slow
async def test_client_disconnect_aborts_and_frees_the_slot(simulator_factory):
    sim = simulator_factory(ttft_ms=10, itl_ms=20, jitter=0, max_num_seqs=1)
    async with aiohttp.ClientSession() as s:
        body = {"messages": BODY["messages"], "max_tokens": 500, "stream": True}
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(sim.base_url + "/chat/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                await r.read()
        await asyncio.sleep(0.2)
        st, _, _ = await asyncio.wait_for(chat(s, sim), 5)  # the only slot is free again
        assert st == 200
    m = scrape(sim)
    assert val(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert val(m, "vllm:num_requests_running") == 0


async def test_sleep_wake_and_prefix_cache_reset(simulator):
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": " ".join(["word"] * 60)}], "max_tokens": 1}
        _, d1, _ = await chat(s, simulator, body)
        _, d2, _ = await chat(s, simulator, body)
        assert d1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        async with s.post(simulator.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        _, d3, _ = await chat(s, simulator, body)
        assert d3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        async with s.post(simulator.url + "/sleep", params={"level": "1"}) as r:
            assert r.status == 200
        async with s.get(simulator.url + "/is_sleeping") as r:
            assert (await r.json())["is_sleeping"] is True
        assert val(scrape(simulator), "vllm:engine_sleep_state") == 1
        task = asyncio.create_task(chat(s, simulator))
        await asyncio.sleep(0.2)
        assert not task.done()  # a sleeping engine generates nothing
        async with s.post(simulator.url + "/wake_up") as r:
            assert r.status == 200
        st, _, _ = await asyncio.wait_for(task, 5)
        assert st == 200
        async with s.get(simulator.url + "/is_sleeping") as r:
            assert (await r.json())["is_sleeping"] is False


@pytest.mark.parametrize("question, expected", [
    ("What is 17 + 25?", 42), ("What is $6 \\times 7$?", 42), ("What is \\(6 \\cdot 7\\)? Box it.", 42),
    ("what is 6 × 7", 42), ("what is 6 · 7", 42), ("Compute -3 * 4", -12), ("calculate -5 - 7", -12),
])
def test_arithmetic_styles_score_at_the_configured_accuracy(question, expected):
    import random

    from workers.simulator.text import generate, solve

    assert solve(question)[3] == expected
    rng = random.Random(5)
    outcomes = [generate(rng, 12, question, 0.7)[1] for _ in range(400)]
    assert all(o is not None and o["expected"] == expected for o in outcomes)
    right = sum(o["given"] == expected for o in outcomes) / len(outcomes)
    assert 0.62 < right < 0.78  # the accuracy setting, not 0 (an unparsed question has no right answer)


def test_text_without_arithmetic_is_not_scored():
    from workers.simulator.text import solve

    assert solve("What is the capital of France?") is None and solve("6 \\times 7") is None
