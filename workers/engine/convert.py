"""Request building and answer conversion between API flavors and NeMo Gym's Responses shape.

Pure functions (no I/O), unit-tested in tests/workers/test_convert*.py.

Requests: a row's `responses_create_params` (Responses API create params) becomes
  - chat_completions: POST /v1/chat/completions with `messages` (a string `input` is one user message;
    `instructions` becomes a leading system message), `max_output_tokens` -> `max_tokens`;
  - completions: POST /v1/completions with a flattened `prompt` (see `flatten_prompt`);
  - responses: POST /v1/responses with the params passed through.
Answers are converted into the Responses object of FORMATS.md (`to_response_*`).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

PATHS = {
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}

# Responses create params with no chat/completions counterpart (dropped), or mapped explicitly.
_RESPONSES_ONLY = {
    "input", "instructions", "max_output_tokens", "model", "stream", "stream_options", "store", "include",
    "truncation", "previous_response_id", "background", "text", "reasoning", "tools", "tool_choice",
    "metadata", "prompt", "conversation", "max_tool_calls", "parallel_tool_calls", "user", "prompt_cache_key",
    "safety_identifier",
}

_FINISH_TO_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


# ---------------------------------------------------------------------------------------------- input

def _content_text(content: Any) -> str:
    """Text of a Responses message content: a string, or a list of parts ({type: input_text, text})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


def input_messages(params: dict) -> list[dict]:
    """Chat messages from Responses create params (`instructions` + `input`)."""
    messages: list[dict] = []
    instructions = params.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": _content_text(instructions)})
    inp = params.get("input")
    if inp is None:
        return messages
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
        return messages
    if not isinstance(inp, list):
        raise ValueError(f"responses_create_params.input must be a string or a list, not {type(inp).__name__}")
    for item in inp:
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
            continue
        if not isinstance(item, dict):
            raise ValueError(f"unsupported input item {item!r:.80}")
        kind = item.get("type", "message")
        if kind == "message" or "role" in item and kind not in ("function_call", "function_call_output", "reasoning"):
            role = item.get("role", "user")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"unsupported message role {role!r}")
            messages.append({"role": role, "content": _content_text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or "", "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": _content_text(item.get("output"))})
        elif kind == "reasoning":
            continue  # prior reasoning is not replayed to chat endpoints
        else:
            raise ValueError(f"unsupported input item type {kind!r}")
    return messages


def flatten_prompt(messages: list[dict]) -> str:
    """A completions prompt from chat messages.

    A lone user message is sent verbatim; otherwise each message becomes "Role: content" separated by
    blank lines, ending with "Assistant:" so a base model continues as the assistant.
    """
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"] or ""
    parts = [f"{m['role'].capitalize()}: {m.get('content') or ''}" for m in messages]
    parts.append("Assistant:")
    return "\n\n".join(parts)


def _chat_tools(tools: list) -> list:
    out = []
    for tool in tools:
        if tool.get("type") == "function" and "function" not in tool:
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            out.append({"type": "function", "function": fn})
        else:
            out.append(tool)
    return out


def _sampling_params(params: dict) -> dict:
    body = {k: v for k, v in params.items() if k not in _RESPONSES_ONLY}
    if params.get("max_output_tokens") is not None:
        body["max_tokens"] = params["max_output_tokens"]
    return body


def _extra_body(params: dict) -> dict:
    """metadata.extra_body (a JSON object in a string, as NeMo Gym's num_repeats_add_seed writes it): fields a
    NeMo Gym vLLM model server passes on to the model (e.g. "seed")."""
    metadata = params.get("metadata")
    raw = metadata.get("extra_body") if isinstance(metadata, dict) else None
    if not isinstance(raw, str):
        return {}
    try:
        extra = json.loads(raw)
    except ValueError:
        return {}
    return extra if isinstance(extra, dict) else {}


def build_request(flavor: str, params: dict, model: str, stream: bool) -> tuple[str, dict]:
    """(path, JSON body) for one request. `params` are the row's merged responses_create_params."""
    if flavor == "chat_completions":
        body = _sampling_params(params)
        body["messages"] = input_messages(params)
        if params.get("tools"):
            body["tools"] = _chat_tools(params["tools"])
            for key in ("tool_choice", "parallel_tool_calls"):
                if key in params:
                    body[key] = params[key]
        effort = (params.get("reasoning") or {}).get("effort") if isinstance(params.get("reasoning"), dict) else None
        if effort:
            body["reasoning_effort"] = effort
    elif flavor == "completions":
        body = _sampling_params(params)
        body["prompt"] = flatten_prompt(input_messages(params))
    elif flavor == "responses":
        body = dict(params)
    else:
        raise ValueError(f"unknown api_flavor {flavor!r}; expected one of {', '.join(PATHS)}")
    if flavor != "responses":
        body.update(_extra_body(params))
    body["model"] = model
    if stream:
        body["stream"] = True
        if flavor != "responses":
            body["stream_options"] = {"include_usage": True}
    else:
        body.pop("stream", None)
        body.pop("stream_options", None)
    return PATHS[flavor], body


# --------------------------------------------------------------------------------------------- output

def _usage(prompt_tokens, completion_tokens, total_tokens=None, cached=None, reasoning=None) -> dict:
    prompt_tokens = int(prompt_tokens or 0)
    completion_tokens = int(completion_tokens or 0)
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": int(cached or 0)},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": int(reasoning or 0)},
        "total_tokens": int(total_tokens) if total_tokens is not None else prompt_tokens + completion_tokens,
    }


def usage_from_chat(usage: dict | None) -> dict | None:
    if not usage:
        return None
    return _usage(
        usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens"),
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        (usage.get("completion_tokens_details") or {}).get("reasoning_tokens"),
    )


def _response_object(rid, created, model, text, finish_reason, usage, reasoning_text=None, tool_calls=None,
                     prompt_token_ids=None, generation_token_ids=None) -> dict:
    """`prompt_token_ids` / `generation_token_ids`: what vLLM answers with `return_token_ids` (the tokens it read
    and sampled), kept on the message item under NeMo Gym's names for training, so a trainer scores exactly the
    sampled tokens (the text alone does not give them back: byte pieces decode to U+FFFD)."""
    output: list[dict] = []
    if reasoning_text:
        output.append({"id": f"rs_{rid}", "type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning_text}]})
    if text or not tool_calls:
        message = {
            "id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text or "", "annotations": []}],
        }
        if generation_token_ids is not None:
            message["prompt_token_ids"] = list(prompt_token_ids or [])
            message["generation_token_ids"] = list(generation_token_ids)
        output.append(message)
    for call in tool_calls or []:
        fn = call.get("function") or {}
        output.append({"id": f"fc_{call.get('id', '')}", "type": "function_call", "call_id": call.get("id", ""),
                       "name": fn.get("name", ""), "arguments": fn.get("arguments", ""), "status": "completed"})
    incomplete = _FINISH_TO_INCOMPLETE.get(finish_reason or "")
    if incomplete:
        for item in output:
            if item["type"] == "message":
                item["status"] = "incomplete"
    return {
        "id": rid if str(rid).startswith("resp") else f"resp_{rid}",
        "object": "response",
        "created_at": created or int(time.time()),
        "model": model,
        "output": output,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "usage": usage,
    }


def _new_id() -> str:
    return uuid.uuid4().hex


def to_response_from_chat(chat: dict) -> dict:
    """A (non-streamed) chat completion -> Responses object."""
    choices = chat.get("choices")
    if not choices or not isinstance(choices, list):
        raise ValueError("chat completion has no choices")
    choice = choices[0]
    message = choice.get("message") or {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return _response_object(
        chat.get("id") or _new_id(), chat.get("created"), chat.get("model"), message.get("content") or "",
        choice.get("finish_reason"), usage_from_chat(chat.get("usage")), reasoning, message.get("tool_calls"),
        chat.get("prompt_token_ids"), choice.get("token_ids"),
    )


def to_response_from_completion(comp: dict) -> dict:
    """A (non-streamed) completion -> Responses object."""
    choices = comp.get("choices")
    if not choices or not isinstance(choices, list):
        raise ValueError("completion has no choices")
    choice = choices[0]
    return _response_object(
        comp.get("id") or _new_id(), comp.get("created"), comp.get("model"), choice.get("text") or "",
        choice.get("finish_reason"), usage_from_chat(comp.get("usage")),
    )


def to_response_from_responses(resp: dict) -> dict:
    """A Responses API answer is already in shape; normalize its usage block."""
    if not isinstance(resp, dict) or "output" not in resp:
        raise ValueError("responses answer has no output")
    out = dict(resp)
    usage = resp.get("usage")
    if usage:
        out["usage"] = _usage(
            usage.get("input_tokens"), usage.get("output_tokens"), usage.get("total_tokens"),
            (usage.get("input_tokens_details") or {}).get("cached_tokens"),
            (usage.get("output_tokens_details") or {}).get("reasoning_tokens"),
        )
    out.setdefault("status", "completed")
    out.setdefault("incomplete_details", None)
    return out


def response_text(response: dict) -> str:
    """The assistant's text: every output_text of every message item, concatenated."""
    texts = []
    for item in response.get("output") or ():
        if item.get("type") == "message":
            for part in item.get("content") or ():
                if part.get("type") == "output_text":
                    texts.append(part.get("text") or "")
    return "".join(texts)


class StreamAccumulator:
    """Accumulates streamed chunks (chat completions, completions, or Responses SSE events).

    `feed(event)` takes one decoded `data:` JSON object and returns True when it carried generated
    content (text, reasoning or a tool-call delta): the engine times the first and last of those.
    `response()` returns the Responses object once the stream is done.
    """

    __slots__ = ("flavor", "id", "created", "model", "text", "reasoning", "finish_reason", "usage", "tool_calls", "final",
                 "prompt_token_ids", "token_ids")

    def __init__(self, flavor: str):
        self.flavor = flavor
        self.id = None
        self.created = None
        self.model = None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason = None
        self.usage = None
        self.tool_calls: dict[int, dict] = {}
        self.final = None  # responses flavor: the response.completed payload
        self.prompt_token_ids = None  # vLLM's return_token_ids: the prompt's (first chunk) and each chunk's sampled
        self.token_ids: list[int] | None = None

    def feed(self, event: dict) -> bool:
        if self.flavor == "responses":
            return self._feed_responses(event)
        if "error" in event and not event.get("choices"):
            err = event["error"]
            raise ValueError(f"error in stream: {err.get('message', err) if isinstance(err, dict) else err}")
        if self.id is None:
            self.id = event.get("id")
            self.created = event.get("created")
            self.model = event.get("model")
        if event.get("usage"):
            self.usage = event["usage"]
        if event.get("prompt_token_ids") is not None:
            self.prompt_token_ids = event["prompt_token_ids"]
        content = False
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if choice.get("token_ids") is not None:
                if self.token_ids is None:
                    self.token_ids = []
                self.token_ids.extend(choice["token_ids"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if self.flavor == "completions":
                piece = choice.get("text")
                if piece:
                    self.text.append(piece)
                    content = True
                continue
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if piece:
                self.text.append(piece)
                content = True
            piece = delta.get("reasoning_content") or delta.get("reasoning")
            if piece:
                self.reasoning.append(piece)
                content = True
            for tc in delta.get("tool_calls") or ():
                slot = self.tool_calls.setdefault(tc.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]
                content = True
        return content

    def _feed_responses(self, event: dict) -> bool:
        kind = event.get("type", "")
        if kind.endswith(".delta"):
            if kind == "response.output_text.delta":
                self.text.append(event.get("delta") or "")
            return True
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.final = event.get("response")
        elif kind == "error":
            raise ValueError(f"error in stream: {event.get('message') or event}")
        return False

    def response(self) -> dict:
        if self.flavor == "responses":
            if self.final is None:
                raise ValueError("stream ended without response.completed")
            return to_response_from_responses(self.final)
        if self.id is None:
            raise ValueError("stream ended without any chunk")
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)] or None
        return _response_object(
            self.id, self.created, self.model, "".join(self.text), self.finish_reason,
            usage_from_chat(self.usage), "".join(self.reasoning) or None, calls, self.prompt_token_ids, self.token_ids,
        )


def parse_sse_line(line: bytes) -> dict | None | bool:
    """One SSE line -> the decoded `data:` JSON object, None for lines to skip, False for `[DONE]`."""
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if not data:
        return None
    if data == b"[DONE]":
        return False
    return json.loads(data)


def convert_answer(flavor: str, body: dict) -> dict:
    if flavor.startswith("nemo_gym"):  # a NeMo Gym agent's /run answer is kept as it is
        return body
    if flavor == "chat_completions":
        return to_response_from_chat(body)
    if flavor == "completions":
        return to_response_from_completion(body)
    return to_response_from_responses(body)


def decode_sse_events(datas: list[bytes]) -> list:
    """The JSON payloads of several SSE `data:` lines, decoded with one json.loads (as one array) instead of
    one call per event (a streamed answer has one event per token). Falls back to one call per line, which
    raises the same error as before, when the joined text is not exactly one value per line."""
    if len(datas) == 1:
        return [json.loads(datas[0])]
    if not datas:
        return []
    try:
        events = json.loads(b"[" + b",".join(datas) + b"]")
    except ValueError:
        events = None
    if isinstance(events, list) and len(events) == len(datas):
        return events
    return [json.loads(d) for d in datas]
