"""Rows -> `/run` bodies, and `/run` answers -> output rows, as `ng_collect_rollouts` does it.

Body: the row as it is (nothing removed) with `agent_ref = {"name": agent}` set when the row has none,
`responses_create_params = row[...] | overrides` (a SHALLOW merge, as NeMo Gym does, unlike the built-in
engine's deep merge), `_ng_task_index` and `_ng_rollout_index`.
Answer: the resources server's verify result (unknown top-level fields dropped by the agent), to which
the caller re-attaches `_ng_task_index`, `_ng_rollout_index`, `agent_ref` (and `skills_ref`).
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


def output_row(answer: dict, body: dict) -> dict:
    """The stored rollout: the agent's answer with the caller's indices and agent_ref re-attached."""
    out = dict(answer)
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
