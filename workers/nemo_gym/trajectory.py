"""The turns of an agent's rollout, from the Responses API object its /run returned (the stored row's `response`).

A NeMo Gym agent's response lists, in order, what each model call produced (reasoning, an assistant message,
function calls) and the tool results it fed back (`function_call_output`). A turn is one model call: a run of
model-produced items; the tool results that answer its calls (by call_id) are attached to them. Per-call
tokens, TTFT or finish reason are shown when an item carries them (`usage`, `ttft_ms`, `finish_reason`). NeMo Gym
0.4.0's agents record only the whole response's usage, but a model server asked for token ids
(vllm_model's `return_token_id_information`, as RL training runs it) puts each call's `prompt_token_ids` and
`generation_token_ids` on the last item the call produced: its tokens in and out are counted from them. Where no
item names a finish reason, it is read from the response as vllm_model writes it: a call that asked for tools
ended with `tool_calls`; the last one with `length` when the response is incomplete for max_output_tokens, else
`stop`. TTFT per call is not in a 0.4.0 agent's response."""
from __future__ import annotations

import json
from typing import Any

MODEL_ITEMS = ("message", "reasoning", "function_call")
PER_CALL_KEYS = ("usage", "ttft_ms", "finish_reason")


def _text(parts) -> str:
    if isinstance(parts, str):
        return parts
    if isinstance(parts, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in parts).strip()
    return ""


def _args(value) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def trajectory(data: Any) -> list[dict]:
    """[{"index", "reasoning", "messages", "tool_calls": [{"call_id", "name", "arguments", "output"}], "call": {...}}]
    for a multi-step rollout; [] when the response is a single answer (nothing to show turn by turn)."""
    response = data.get("response") if isinstance(data, dict) else None
    items = response.get("output") if isinstance(response, dict) else None
    if not isinstance(items, list):
        return []
    turns: list[dict] = []
    calls: dict[str, dict] = {}
    current: dict | None = None
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or ("message" if item.get("role") == "assistant" else "")
        if kind == "function_call_output":
            call = calls.get(str(item.get("call_id")))
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
            if call is not None:
                call["output"] = text
            else:  # a result whose call is not in the response: shown on its own
                (current or _new(turns))["tool_calls"].append(
                    {"call_id": str(item.get("call_id") or ""), "name": "", "arguments": "", "output": text})
            current = None  # the next model item starts a new model call
            continue
        if kind not in MODEL_ITEMS:
            continue
        if current is None:
            current = _new(turns)
        for key in PER_CALL_KEYS:
            if key in item:
                current["call"][key] = item[key]
        prompt_ids, gen_ids = item.get("prompt_token_ids"), item.get("generation_token_ids")
        if "usage" not in current["call"] and isinstance(prompt_ids, list) and isinstance(gen_ids, list):
            current["call"]["usage"] = {"input_tokens": len(prompt_ids), "output_tokens": len(gen_ids)}
        if kind == "reasoning":
            current["reasoning"].append(_text(item.get("summary") or item.get("content")))
        elif kind == "message":
            current["messages"].append(_text(item.get("content")))
        else:
            call = {"call_id": str(item.get("call_id") or item.get("id") or ""), "name": str(item.get("name") or ""),
                    "arguments": _args(item.get("arguments")), "output": None}
            current["tool_calls"].append(call)
            calls[call["call_id"]] = call
    if len(turns) <= 1 and not any(t["tool_calls"] for t in turns):
        return []
    incomplete = response.get("incomplete_details")
    for turn in turns:
        if "finish_reason" not in turn["call"] and (turn["tool_calls"] or turn is turns[-1]):
            turn["call"]["finish_reason"] = "tool_calls" if any(c["name"] for c in turn["tool_calls"]) else (
                "length" if isinstance(incomplete, dict) and incomplete.get("reason") == "max_output_tokens" else "stop")
    return turns


def _new(turns: list[dict]) -> dict:
    turn = {"index": len(turns) + 1, "reasoning": [], "messages": [], "tool_calls": [], "call": {}}
    turns.append(turn)
    return turn
