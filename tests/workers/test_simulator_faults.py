"""Fault injection (by header and by rate), hosted-API RPM/TPM limits, queue-full 429s."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

pytestmark = pytest.mark.timeout(60)

BODY = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}


async def post(s, sim, headers=None, body=None, stream=False, timeout=None):
    b = dict(body or BODY)
    if stream:
        b["stream"] = True
    return await s.post(sim.base_url + "/chat/completions", json=b, headers=headers or {}, timeout=timeout)


async def test_header_429_with_retry_after(simulator):
    async with aiohttp.ClientSession() as s:
        async with await post(s, simulator, {"X-Sim-Fault": "429"}) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "1"  # default retry_after_s = 1
            assert (await r.json())["error"]["type"] == "RateLimitError"
        async with await post(s, simulator, {"X-Sim-Fault": "429", "X-Sim-Retry-After": "2"}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "2"
        # the header forces one request only; the next is fine
        async with await post(s, simulator) as r:
            assert r.status == 200


@pytest.mark.parametrize("kind,status", [("500", 500), ("503", 503)])
async def test_header_5xx(simulator, kind, status):
    async with aiohttp.ClientSession() as s:
        async with await post(s, simulator, {"X-Sim-Fault": kind}) as r:
            assert r.status == status
            assert (await r.json())["error"]["code"] == status
        async with await post(s, simulator, {"X-Sim-Fault": kind}, stream=True) as r:
            assert r.status == status


async def test_header_400_context_length(simulator):
    async with aiohttp.ClientSession() as s:
        async with await post(s, simulator, {"X-Sim-Fault": "400"}) as r:
            assert r.status == 400
            data = await r.json()
    assert "maximum context length is 8192 tokens" in data["error"]["message"]
    assert data["message"] == data["error"]["message"]  # old flat shape too


async def test_stall_until_client_timeout(simulator):
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            async with await post(s, simulator, {"X-Sim-Fault": "stall"}, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        assert 0.4 < time.perf_counter() - t0 < 5
        # the server is still fine afterwards
        async with await post(s, simulator) as r:
            assert r.status == 200


async def test_drop_plain_is_connection_error(simulator):
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with await post(s, simulator, {"X-Sim-Fault": "drop"}) as r:
                await r.read()
        async with await post(s, simulator) as r:
            assert r.status == 200


async def test_drop_mid_stream(simulator_factory):
    sim = simulator_factory(ttft_ms=5, itl_ms=5, jitter=0)
    got = []
    async with aiohttp.ClientSession() as s:
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
            async with await post(s, sim, {"X-Sim-Fault": "drop"}, body={**BODY, "max_tokens": 10}, stream=True) as r:
                assert r.status == 200  # headers and some tokens arrived...
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(line)
    assert got and not any(b"[DONE]" in g for g in got)  # ...then the connection died before [DONE]


async def test_drop_mid_stream_zero_latency(simulator):
    async with aiohttp.ClientSession() as s:
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)):
            async with await post(s, simulator, {"X-Sim-Fault": "drop"}, stream=True) as r:
                await r.read()


async def test_unknown_fault_header_is_400(simulator):
    async with aiohttp.ClientSession() as s:
        async with await post(s, simulator, {"X-Sim-Fault": "explode"}) as r:
            assert r.status == 400
            assert "unknown fault type" in (await r.json())["error"]["message"]


async def test_fault_rates_mix(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, seed=5, fault_rates={"429": 0.3, "500": 0.2})
    counts: dict[int, int] = {}
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            async with await post(s, sim) as r:
                counts[r.status] = counts.get(r.status, 0) + 1
                if r.status == 429:
                    assert "Retry-After" in r.headers
    assert set(counts) == {200, 429, 500}
    assert 60 <= counts[429] <= 120  # 0.3 * 300 = 90
    assert 35 <= counts[500] <= 85  # 0.2 * 300 = 60
    # runtime change: faults off
    sim.configure(fault_rates={})
    async with aiohttp.ClientSession() as s:
        statuses = []
        for _ in range(20):
            async with await post(s, sim) as r:
                statuses.append(r.status)
    assert statuses == [200] * 20


async def test_rpm_limit(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, rpm_limit=5)
    statuses, retry = [], []
    async with aiohttp.ClientSession() as s:
        for _ in range(8):
            async with await post(s, sim) as r:
                statuses.append(r.status)
                if r.status == 429:
                    retry.append(int(r.headers["Retry-After"]))
    assert statuses == [200] * 5 + [429] * 3
    assert all(55 <= x <= 60 for x in retry)  # the oldest request leaves the 60 s window in ~60 s
    sim.configure(rpm_limit=0)  # hosted mode off at runtime
    async with aiohttp.ClientSession() as s:
        async with await post(s, sim) as r:
            assert r.status == 200


async def test_tpm_limit(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, tpm_limit=100)
    statuses = []
    async with aiohttp.ClientSession() as s:
        # each request costs prompt (~ 12 tokens) + max_tokens 30 -> two fit in 100, the third does not
        for _ in range(3):
            async with await post(s, sim, body={**BODY, "max_tokens": 30}) as r:
                statuses.append(r.status)
                if r.status == 429:
                    assert int(r.headers["Retry-After"]) >= 1
    assert statuses == [200, 200, 429]


@pytest.mark.slow
async def test_queue_full_429(simulator_factory):
    sim = simulator_factory(ttft_ms=300, itl_ms=0, jitter=0, max_num_seqs=1, max_queue=1, retry_after_s=3)
    async with aiohttp.ClientSession() as s:
        async def one():
            async with await post(s, sim, body={**BODY, "max_tokens": 1}) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")

        results = await asyncio.gather(*[one() for _ in range(4)])
    statuses = sorted(st for st, _ in results)
    assert statuses == [200, 200, 429, 429]  # one running, one waiting, two refused
    assert all(ra == "3" for st, ra in results if st == 429)


async def test_unhealthy(simulator):
    simulator.configure(unhealthy=True)
    async with aiohttp.ClientSession() as s:
        async with s.get(simulator.url + "/health") as r:
            assert r.status == 503
        async with await post(s, simulator) as r:
            assert r.status == 503
    simulator.configure(unhealthy=False)
    async with aiohttp.ClientSession() as s:
        async with s.get(simulator.url + "/health") as r:
            assert r.status == 200


@pytest.mark.slow
async def test_hang_holds_every_route_but_admin_config_until_cleared(simulator):
    simulator.configure(hang=True)
    short = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession() as s:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/v1/models")):
            with pytest.raises(asyncio.TimeoutError):
                async with s.request(method, simulator.url + path, json=BODY, timeout=short) as r:
                    await r.read()
        held = asyncio.ensure_future(post(s, simulator, timeout=aiohttp.ClientTimeout(total=10)))
        await asyncio.sleep(0.3)
        assert not held.done()  # hanging (the connection was accepted)
        assert simulator.config()["hang"] is True  # /admin/config still answers
        simulator.configure(hang=False)
        async with await held as r:  # a request caught in the hang carries on once it is cleared
            assert r.status == 200
        async with s.get(simulator.url + "/health") as r:
            assert r.status == 200
