"""The simulator as a tool-calling model (knob `tool_calls`): a chat request offering tools gets a call of the first
tool until a tool result follows the user's message, then a text answer; logprobs in vLLM's shape (token ids as
NeMo Gym's vllm_model asks for them); a `metadata.traceparent` in the body is recorded at /admin/traceparents."""
from __future__ import annotations

import json
import re

import aiohttp
import pytest

from workers.simulator.text import count_tokens

pytestmark = pytest.mark.timeout(60)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "what's it like in sf?"}]


async def chat(s, sim, body, headers=None):
    async with s.post(sim.base_url + "/chat/completions", json={"model": sim.model, **body}, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_tool_call_then_text_answer(simulator):
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    async with aiohttp.ClientSession() as s:
        first = await chat(s, simulator, {"messages": ASK, "tools": [TOOL], "metadata": {"traceparent": tp}})
        choice = first["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "sf"})}
        assert first["usage"]["completion_tokens"] == count_tokens(call["function"]["arguments"])

        assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
        tool = {"role": "tool", "tool_call_id": call["id"], "content": '{"weather": "cold"}'}
        second = await chat(s, simulator, {"messages": [*ASK, assistant, tool], "tools": [TOOL], "max_tokens": 7,
                                           "logprobs": True, "return_tokens_as_token_ids": True})
        choice = second["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
        assert second["usage"]["completion_tokens"] == 7
        lps = choice["logprobs"]["content"]
        assert len(lps) == 7 and all(re.fullmatch(r"token_id:\d+", x["token"]) and x["logprob"] <= 0 for x in lps)
        # the call is part of the prompt the model was given (as /tokenize counts it)
        assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + count_tokens(call["function"]["arguments"])

        # no call when the request says tool_choice none, nor with the knob off
        plain = await chat(s, simulator, {"messages": ASK, "tools": [TOOL], "tool_choice": "none"})
        assert plain["choices"][0]["finish_reason"] == "stop" and plain["choices"][0]["message"]["content"]
        async with s.post(simulator.url + "/admin/config", json={"tool_calls": False}) as r:
            assert r.status == 200
        off = await chat(s, simulator, {"messages": ASK, "tools": [TOOL]})
        assert off["choices"][0]["message"]["tool_calls"] == []
        async with s.get(simulator.url + "/admin/traceparents") as r:
            seen = await r.json()
        assert seen["metadata_traceparents"] == [tp] and seen["traceparents"] == []
