"""The simulator's OpenAI surface over real HTTP: formats, streaming, usage, auth, tokenize."""
from __future__ import annotations

import json

import aiohttp
import pytest

from workers.simulator.text import count_tokens, render_chat

pytestmark = pytest.mark.timeout(60)

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world, please."}]


async def read_sse(resp) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    out, buf = [], b""
    async for chunk in resp.content.iter_any():
        buf += chunk
    for block in buf.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                out.append(line[6:])
    return out


async def test_models_health_version(simulator):
    async with aiohttp.ClientSession() as s:
        async with s.get(simulator.url + "/health") as r:
            assert r.status == 200
        async with s.get(simulator.url + "/ping") as r:
            assert r.status == 200
        async with s.get(simulator.base_url + "/models") as r:
            data = await r.json()
            assert [m["id"] for m in data["data"]] == [simulator.model]
            assert data["data"][0]["max_model_len"] == 8192
        async with s.get(simulator.url + "/version") as r:
            assert "version" in await r.json()


async def test_chat_plain_shape_and_usage(simulator):
    async with aiohttp.ClientSession() as s:
        body = {"model": simulator.model, "messages": MSGS, "max_tokens": 12}
        async with s.post(simulator.base_url + "/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["X-Weight-Version"] == "0"
            data = await r.json()
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    text = choice["message"]["content"]
    assert text and count_tokens(text) == 12  # plain words: one word = one token
    u = data["usage"]
    assert u["completion_tokens"] == 12
    assert u["prompt_tokens"] == count_tokens(render_chat(MSGS))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert data["weight_version"] == 0


async def test_chat_stream_format_usage_and_done(simulator):
    async with aiohttp.ClientSession() as s:
        body = {"model": simulator.model, "messages": MSGS, "max_tokens": 9, "stream": True,
                "stream_options": {"include_usage": True}}
        async with s.post(simulator.base_url + "/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await read_sse(r)
        plain = {"model": simulator.model, "messages": MSGS, "max_tokens": 9}
        async with s.post(simulator.base_url + "/chat/completions", json=plain) as r:
            plain_usage = (await r.json())["usage"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(deltas) == 9  # one chunk per token
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 9
    # the streamed usage and the plain usage agree (the prefix cache only changes cached_tokens)
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][k] == plain_usage[k]
    assert count_tokens("".join(deltas)) == 9


async def test_stream_without_include_usage_has_no_usage_chunk(simulator):
    async with aiohttp.ClientSession() as s:
        body = {"messages": MSGS, "max_tokens": 3, "stream": True}
        async with s.post(simulator.base_url + "/chat/completions", json=body) as r:
            events = await read_sse(r)
    assert events[-1] == "[DONE]"
    assert not any("usage" in json.loads(e) for e in events[:-1])


async def test_stream_with_latency_is_incremental(simulator_factory):
    # 50 ms between tokens: a reader that a loaded machine schedules late (tens of ms) still sees them apart
    sim = simulator_factory(ttft_ms=30, itl_ms=50, jitter=0)
    async with aiohttp.ClientSession() as s:
        body = {"messages": MSGS, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        import time
        t0 = time.perf_counter()
        arrivals = []
        async with s.post(sim.base_url + "/chat/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: ") and b'"content":"' in line and b'"content":""' not in line:
                    arrivals.append(time.perf_counter() - t0)
    assert len(arrivals) == 6
    assert arrivals[0] >= 0.025  # TTFT
    assert arrivals[-1] - arrivals[0] >= 5 * 0.05 * 0.6  # 5 inter-token gaps of 50 ms, not one burst


async def test_completions_plain_and_stream(simulator):
    async with aiohttp.ClientSession() as s:
        async with s.post(simulator.base_url + "/completions", json={"prompt": "one two three", "max_tokens": 4}) as r:
            data = await r.json()
        assert data["object"] == "text_completion"
        assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        body = {"prompt": "one two three", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(simulator.base_url + "/completions", json=body) as r:
            events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["usage"]["prompt_tokens"] == 3


async def test_responses_api_object_and_stream(simulator):
    async with aiohttp.ClientSession() as s:
        body = {"model": simulator.model, "input": [{"role": "user", "content": "Tell me a story"}], "max_output_tokens": 7}
        async with s.post(simulator.base_url + "/responses", json=body) as r:
            data = await r.json()
        async with s.post(simulator.base_url + "/responses", json={**body, "stream": True}) as r:
            events = [json.loads(e) for e in await read_sse(r)]
    assert data["object"] == "response" and data["status"] == "completed"
    msg = data["output"][0]
    assert msg["type"] == "message" and msg["content"][0]["type"] == "output_text"
    u = data["usage"]
    assert u["output_tokens"] == 7 and u["output_tokens_details"]["reasoning_tokens"] == 0
    assert u["input_tokens"] == count_tokens(render_chat([{"role": "user", "content": "Tell me a story"}]))
    assert u["total_tokens"] == u["input_tokens"] + 7
    assert "cached_tokens" in u["input_tokens_details"]
    assert data["metadata"]["weight_version"] == "0"
    types = [e["type"] for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == 7
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "".join(deltas)
    assert events[-1]["response"]["usage"]["output_tokens"] == 7


@pytest.mark.slow
async def test_sampled_length_when_no_max_tokens(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, output_len_min=5, output_len_max=8, seed=3)
    lengths = set()
    async with aiohttp.ClientSession() as s:
        for _ in range(30):
            async with s.post(sim.base_url + "/chat/completions", json={"messages": MSGS}) as r:
                lengths.add((await r.json())["usage"]["completion_tokens"])
    assert lengths <= set(range(5, 9)) and len(lengths) >= 2


async def test_tokenize_agrees_with_usage(simulator):
    async with aiohttp.ClientSession() as s:
        async with s.post(simulator.url + "/tokenize", json={"messages": MSGS}) as r:
            tok = await r.json()
        async with s.post(simulator.base_url + "/chat/completions", json={"messages": MSGS, "max_tokens": 1}) as r:
            usage = (await r.json())["usage"]
        async with s.post(simulator.url + "/tokenize", json={"prompt": "Hello, world!"}) as r:
            tok2 = await r.json()
    assert tok["count"] == usage["prompt_tokens"] == len(tok["tokens"])
    assert tok2["count"] == 4  # Hello , world !


@pytest.mark.slow
async def test_api_key_required_on_v1_only(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, api_key="s3cret")
    async with aiohttp.ClientSession() as s:
        body = {"messages": MSGS, "max_tokens": 2}
        async with s.post(sim.base_url + "/chat/completions", json=body) as r:
            assert r.status == 401
        async with s.post(sim.base_url + "/chat/completions", json=body, headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        async with s.post(sim.base_url + "/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200
        async with s.get(sim.base_url + "/models") as r:
            assert r.status == 401
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200
    assert sim.config()["api_key"] == "***"  # never echoed


async def test_wrong_model_bad_body_and_n(simulator):
    async with aiohttp.ClientSession() as s:
        async with s.post(simulator.base_url + "/chat/completions", json={"model": "other", "messages": MSGS}) as r:
            assert r.status == 404
            assert "does not exist" in (await r.json())["error"]["message"]
        async with s.post(simulator.base_url + "/chat/completions", data=b"not json") as r:
            assert r.status == 400
        async with s.post(simulator.base_url + "/chat/completions", json={"messages": MSGS, "max_tokens": 0}) as r:
            assert r.status == 400
        async with s.post(simulator.base_url + "/chat/completions", json={"messages": MSGS, "n": 2}) as r:
            assert r.status == 400


@pytest.mark.slow
async def test_real_context_length_error(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, max_model_len=64)
    async with aiohttp.ClientSession() as s:
        body = {"messages": MSGS, "max_tokens": 60}
        async with s.post(sim.base_url + "/chat/completions", json=body) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert "maximum context length is 64 tokens" in err["message"]
    assert err["type"] == "BadRequestError" and err["code"] == 400


def test_session_fixture_and_factory_helpers(simulator_session):
    assert simulator_session.proc.poll() is None
    assert simulator_session.get_json("/v1/models")["data"][0]["id"] == simulator_session.model
    assert "vllm:num_requests_running" in simulator_session.metrics_text()
