"""The simulator's response formats: one class per OpenAI API (chat completions, completions, Responses),
each building whole responses and stream chunks for one request."""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from .text import token_id

if TYPE_CHECKING:
    from .server import Sim

_dumps = json.dumps
_ENC: dict[str, str] = {}


def _enc(tok: str) -> str:
    """JSON string literal of a token, memoized (the synthetic vocabulary is small)."""
    e = _ENC.get(tok)
    if e is None:
        e = _dumps(tok)
        if len(_ENC) < 100_000:
            _ENC[tok] = e
    return e


def _include_usage(body) -> bool:
    so = body.get("stream_options")
    return isinstance(so, dict) and bool(so.get("include_usage"))


class _Fmt:
    """What every response format keeps about one request; `id_kind` prefixes its id."""
    id_kind = ""

    def __init__(self, sim: Sim, body, model, n_prompt, tokens):
        self.sim = sim
        self.body = body
        self.model = model
        self.n_prompt = n_prompt
        self.tokens = tokens
        self.id = sim.next_id(self.id_kind)
        self.created = int(time.time())


class _ChatFmt(_Fmt):
    obj = "chat.completion"
    id_kind = "chatcmpl"

    def __init__(self, sim: Sim, body, model, n_prompt, tokens):
        super().__init__(sim, body, model, n_prompt, tokens)
        self._head = '{"id":"%s","object":"%s.chunk","created":%d,"model":%s,"choices":[{"index":0,' % (
            self.id, self.obj, self.created, _dumps(model))

    def usage(self, req):
        return {"prompt_tokens": self.n_prompt, "total_tokens": self.n_prompt + req.generated,
                "completion_tokens": req.generated, "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}

    tool_call = None  # (call id, tool name, JSON arguments) when the simulated model calls a tool

    def full(self, req):
        text, finish, calls = "".join(self.tokens[:req.generated]), req.finish_reason, []
        if self.tool_call is not None and req.generated == len(self.tokens):
            call_id, name, args = self.tool_call
            calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]
            text, finish = None, "tool_calls" if finish == "stop" else finish
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                     "reasoning_content": None, "tool_calls": calls},
                             "logprobs": self.logprobs(req), "finish_reason": finish, "stop_reason": None}],
                "usage": self.usage(req), "prompt_logprobs": None, "weight_version": req.weight_version}

    def logprobs(self, req):
        """With `logprobs`: each output token and a synthetic log-probability (vLLM's shape; the token as
        `token_id:N` with `return_tokens_as_token_ids`, as NeMo Gym's vllm_model asks for training data)."""
        if not self.body.get("logprobs"):
            return None
        ids = bool(self.body.get("return_tokens_as_token_ids"))
        return {"content": [{"token": f"token_id:{token_id(t)}" if ids else t, "logprob": -(token_id(t) % 97) / 100.0,
                             "bytes": None, "top_logprobs": []} for t in self.tokens[:req.generated]]}

    def stream_head(self):
        return 'data: ' + self._head + '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'

    def stream_tokens(self, a, b):
        h = self._head
        return ['data: %s"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n' % (h, _enc(t))
                for t in self.tokens[a:b]]

    def stream_tail(self, req):
        wv = req.weight_version
        out = ['data: %s"delta":{},"logprobs":null,"finish_reason":"%s","stop_reason":null}],"weight_version":%d}\n\n'
               % (self._head, req.finish_reason, wv)]
        if _include_usage(self.body):
            out.append('data: %s,"usage":%s,"weight_version":%d}\n\n'
                       % (self._head[:self._head.index('"choices":')] + '"choices":[]', _dumps(self.usage(req)), wv))
        out.append("data: [DONE]\n\n")
        return out

    def stream_all(self, req):
        return [self.stream_head(), *self.stream_tokens(0, req.generated), *self.stream_tail(req)]


class _CompletionFmt(_ChatFmt):
    obj = "text_completion"

    def __init__(self, sim, body, model, n_prompt, tokens):
        super().__init__(sim, body, model, n_prompt, tokens)
        self.id = sim.next_id("cmpl")
        self._head = '{"id":"%s","object":"text_completion","created":%d,"model":%s,"choices":[{"index":0,' % (
            self.id, self.created, _dumps(model))

    def full(self, req):
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": "".join(self.tokens[:req.generated]), "logprobs": None,
                             "finish_reason": req.finish_reason, "stop_reason": None, "prompt_logprobs": None}],
                "usage": self.usage(req), "weight_version": req.weight_version}

    def stream_head(self):
        return ""

    def stream_tokens(self, a, b):
        h = self._head
        return ['data: %s"text":%s,"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n' % (h, _enc(t))
                for t in self.tokens[a:b]]

    def stream_tail(self, req):
        last = {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": req.finish_reason,
                             "stop_reason": None}], "weight_version": req.weight_version}
        out = ["data: " + _dumps(last) + "\n\n"]
        if _include_usage(self.body):
            out.append("data: " + _dumps({"id": self.id, "object": self.obj, "created": self.created,
                                          "model": self.model, "choices": [], "usage": self.usage(req),
                                          "weight_version": req.weight_version}) + "\n\n")
        out.append("data: [DONE]\n\n")
        return out


class _ResponsesFmt(_Fmt):
    id_kind = "resp"

    def __init__(self, sim: Sim, body, model, n_prompt, tokens):
        super().__init__(sim, body, model, n_prompt, tokens)
        self.msg_id = sim.next_id("msg")
        self.seq = 0

    def obj(self, req, status=None):
        done = req is not None and req.finished
        text = "".join(self.tokens[:req.generated]) if done else ""
        status = status or ("completed" if not done or req.finish_reason != "abort" else "incomplete")
        wv = req.weight_version if done else self.sim.engine.weight_version
        out = [{"id": self.msg_id, "type": "message", "status": "completed" if done else "in_progress",
                "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}] if done else []
        usage = None
        if done:
            usage = {"input_tokens": self.n_prompt, "input_tokens_details": {"cached_tokens": req.cached_tokens},
                     "output_tokens": req.generated, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.n_prompt + req.generated}
        b = self.body
        md = dict(b.get("metadata") or {}) if isinstance(b.get("metadata"), dict) else {}
        md["weight_version"] = str(wv)
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "output": out, "usage": usage,
                "incomplete_details": {"reason": "abort"} if status == "incomplete" else None,
                "error": None, "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"), "parallel_tool_calls": True,
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "metadata": md, "weight_version": wv}

    def full(self, req):
        return self.obj(req)

    def _ev(self, typ, **data):
        self.seq += 1
        return f"event: {typ}\ndata: " + _dumps({"type": typ, "sequence_number": self.seq, **data}) + "\n\n"

    def stream_head(self):
        item = {"id": self.msg_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        return (self._ev("response.created", response=self.obj(None, "in_progress"))
                + self._ev("response.in_progress", response=self.obj(None, "in_progress"))
                + self._ev("response.output_item.added", output_index=0, item=item)
                + self._ev("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []}))

    def stream_tokens(self, a, b):
        return [self._ev("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0, delta=t)
                for t in self.tokens[a:b]]

    def stream_tail(self, req):
        text = "".join(self.tokens[:req.generated])
        part = {"type": "output_text", "text": text, "annotations": []}
        final = self.obj(req)
        return [self._ev("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0, text=text),
                self._ev("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0, part=part),
                self._ev("response.output_item.done", output_index=0, item=final["output"][0]),
                self._ev("response.completed" if final["status"] == "completed" else "response.incomplete",
                         response=final)]

    def stream_all(self, req):
        return [self.stream_head(), *self.stream_tokens(0, req.generated), *self.stream_tail(req)]


FORMATS = {"chat": _ChatFmt, "completions": _CompletionFmt, "responses": _ResponsesFmt}
