"""Rows -> `/run` bodies, and `/run` answers -> output rows, as `ng_collect_rollouts` does it.

Body: the row as it is (nothing removed) with `agent_ref = {"name": agent}` set when the row has none,
`responses_create_params = row[...] | overrides` (a SHALLOW merge, as NeMo Gym does, unlike the built-in
engine's deep merge), `_ng_task_index` and `_ng_rollout_index`.
Answer: the resources server's verify result (unknown top-level fields dropped by the agent), to which
the caller re-attaches `_ng_task_index`, `_ng_rollout_index`, `agent_ref` (and `skills_ref`).
Trace: the body sent carries the rollout's `traceparent` in `responses_create_params.metadata` too (`with_trace`):
nemo-gym 0.4.0's agents forward no request header, but pass the request's metadata to every model call, and
vllm_model passes it on to the model server; the output row's request is given back without it (`output_row`).
"""
from __future__ import annotations

from typing import Any

AGENT_REF = "agent_ref"
RCP = "responses_create_params"
TASK_INDEX = "_ng_task_index"
ROLLOUT_INDEX = "_ng_rollout_index"
FAILURE_CLASS_KEY = "_ng_failure_class"
NO_PERSIST_KEY = "_ng_no_persist"  # nemo-gym 0.4.0: a kill-shaped failure, written nowhere and retried on resume
SKILLS_REF = "skills_ref"


def agent_of(row: dict, default: str | None) -> str | None:
    ref = row.get(AGENT_REF)
    if isinstance(ref, dict) and isinstance(ref.get("name"), str) and ref["name"]:
        return ref["name"]
    return default or None


def run_body(row: dict, agent_name: str | None, overrides: dict | None, task_index: int, rollout_index: int,
             add_seed: bool = False) -> dict:
    """The JSON body of `POST {agent}/run` for one (task, repeat). The input row is not modified. `add_seed`:
    NeMo Gym's num_repeats_add_seed (materialize.with_seed)."""
    body = dict(row)
    if agent_name and not isinstance(body.get(AGENT_REF), dict):
        body[AGENT_REF] = {"name": agent_name}
    rcp = body.get(RCP)
    if overrides:
        body[RCP] = {**(rcp if isinstance(rcp, dict) else {}), **overrides}
    body.setdefault(TASK_INDEX, task_index)
    body[ROLLOUT_INDEX] = rollout_index
    if add_seed:
        from workers.engine.materialize import with_seed

        body = with_seed(body, rollout_index)
    return body


TRACE_KEY = "traceparent"
METADATA_MAX_KEYS = 16  # OpenAI's limit on request metadata


def with_trace(body: dict, parent: str) -> dict:
    """`body` with `responses_create_params.metadata.traceparent = parent` (a copy; `body` is not modified), or
    `body` itself when its request names a traceparent already, has no object metadata or holds 16 keys."""
    rcp = body.get(RCP)
    md = rcp.get("metadata") if isinstance(rcp, dict) else None
    if not isinstance(rcp, dict) or not isinstance(md, (dict, type(None))) or TRACE_KEY in (md or {}) \
            or len(md or {}) >= METADATA_MAX_KEYS:
        return body
    return {**body, RCP: {**rcp, "metadata": {**(md or {}), TRACE_KEY: parent}}}


def _without_trace(out: dict, body: dict) -> None:
    """The answer's echo of the request, as the row had it: the traceparent `with_trace` added taken out."""
    sent, got = body.get(RCP), out.get(RCP)
    if not isinstance(sent, dict) or not isinstance(got, dict) or not isinstance(got.get("metadata"), dict):
        return
    if TRACE_KEY not in got["metadata"] or TRACE_KEY in (sent.get("metadata") or {}):
        return
    md = {k: v for k, v in got["metadata"].items() if k != TRACE_KEY}
    out[RCP] = {**got, "metadata": md if md or sent.get("metadata") is not None else None}


def output_row(answer: dict, body: dict) -> dict:
    """The stored rollout: the agent's answer with the caller's indices and agent_ref re-attached."""
    out = dict(answer)
    _without_trace(out, body)
    out[TASK_INDEX] = body[TASK_INDEX]
    out[ROLLOUT_INDEX] = body[ROLLOUT_INDEX]
    if AGENT_REF in body:
        out[AGENT_REF] = body[AGENT_REF]
    if SKILLS_REF in body:  # the run's skills (+skills.path), as NeMo Gym stamps it on each result
        out[SKILLS_REF] = body[SKILLS_REF]
    return out


def verify_fields(answer: dict) -> dict[str, Any]:
    """The verifier's own fields of an answer (everything but the request, the response and the reward)."""
    return {k: v for k, v in answer.items() if k not in (RCP, "response", "reward")}


def aggregate_entry(result: dict) -> dict:
    """A result as `/aggregate_metrics` takes it: without response / responses_create_params, but with
    response.usage."""
    entry = {k: v for k, v in result.items() if k not in ("response", RCP)}
    usage = (result.get("response") or {}).get("usage") if isinstance(result.get("response"), dict) else None
    if usage:
        entry["response"] = {"usage": usage}
    return entry
