"""Real vLLM on CPU (tiny local model): the HTTP surface the product relies on.

Run: .venv/bin/python -m pytest tests/integration/test_vllm_cpu.py -q
(needs `bash scripts/vllm_cpu.sh setup`; `make test` does it.)
"""
from __future__ import annotations

import json
import re
import threading

import pytest
import requests

pytestmark = pytest.mark.vllm

TIMEOUT = 60


def chat(server, content="What is 2 + 2?", max_tokens=8, **extra):
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, **extra}
    return requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)


def metric_value(text: str, name: str) -> float:
    """Sum of all samples of one metric (any labels) in Prometheus text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


def test_health_and_models(vllm_server):
    assert requests.get(f"{vllm_server.url}/health", timeout=TIMEOUT).status_code == 200
    models = requests.get(f"{vllm_server.url}/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_chat_completion(vllm_server):
    r = chat(vllm_server, max_tokens=8)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "tiny"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = data["usage"]
    assert usage["prompt_tokens"] > 0
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The model is deterministic: greedy decoding gives the same answer twice.
    again = chat(vllm_server, max_tokens=8).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_chat_length_limit_and_ignore_eos(vllm_server):
    data = chat(vllm_server, max_tokens=16, ignore_eos=True).json()
    assert data["usage"]["completion_tokens"] == 16
    assert data["choices"][0]["finish_reason"] == "length"


def test_streaming_chunks_usage_and_done(vllm_server):
    # logprobs: each chunk names its tokens, whatever text they make (the shared server's weights may have been
    # updated by an earlier test, and a token can detokenize to nothing, as the tiny model's often do). 48 tokens:
    # vLLM merges the tokens a slow reader has not taken yet into one chunk (its output collector), and on a loaded
    # machine its API process can miss a 12-token answer's whole generation (seen: all 12 in one chunk)
    n = 48
    body = {"model": vllm_server.model, "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True}}
    with requests.post(f"{vllm_server.url}/v1/chat/completions", json=body, stream=True, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    token_chunks = [c for c in chunks if c["choices"] and (c["choices"][0].get("logprobs") or {}).get("content")]
    assert len(token_chunks) >= 2, chunks  # streamed as generated, not in one piece
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in token_chunks) == n, chunks
    # the streamed text is the text of the same request answered whole
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    whole = chat(vllm_server, "Count to five.", max_tokens=n, ignore_eos=True).json()
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finish == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == n
    assert usage_chunk["usage"]["prompt_tokens"] > 0
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + n


def test_metrics_have_vllm_names_and_move(vllm_server):
    before = requests.get(f"{vllm_server.url}/metrics", timeout=TIMEOUT).text
    assert chat(vllm_server, max_tokens=5, ignore_eos=True).status_code == 200
    text = requests.get(f"{vllm_server.url}/metrics", timeout=TIMEOUT).text
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ]:
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), f"{name} missing from /metrics"
    assert 'model_name="tiny"' in text
    assert metric_value(text, "vllm:generation_tokens_total") >= metric_value(before, "vllm:generation_tokens_total") + 5
    assert metric_value(text, "vllm:e2e_request_latency_seconds_count") >= metric_value(before, "vllm:e2e_request_latency_seconds_count") + 1


def test_pause_holds_requests_until_resume(vllm_server):
    url = vllm_server.url
    try:
        r = requests.post(f"{url}/pause", params={"mode": "keep"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert requests.get(f"{url}/is_paused", timeout=TIMEOUT).json()["is_paused"] is True

        # A request sent while paused does not finish until /resume.
        result = {}
        t = threading.Thread(target=lambda: result.update(r=chat(vllm_server, max_tokens=4)), daemon=True)
        t.start()
        t.join(2.0)
        assert t.is_alive(), "a request finished while the engine was paused"
    finally:
        r = requests.post(f"{url}/resume", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert requests.get(f"{url}/is_paused", timeout=TIMEOUT).json()["is_paused"] is False
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert result["r"].status_code == 200, result["r"].text
    assert chat(vllm_server, max_tokens=4).status_code == 200


def test_reset_prefix_cache(vllm_server):
    assert chat(vllm_server, content="A prompt long enough to fill a block or two. " * 4).status_code == 200
    r = requests.post(f"{vllm_server.url}/reset_prefix_cache", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert chat(vllm_server).status_code == 200


def test_tokenize(vllm_server):
    r = requests.post(f"{vllm_server.url}/tokenize", json={"model": "tiny", "prompt": "What is 2 + 2?"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["count"] > 0
