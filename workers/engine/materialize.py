"""NeMo Gym materialization: repeats, task/rollout indices, job-level overrides.

Shared by the engine, the Django side (job chunks) and the CLI.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from workers.task_index import rollout_indices

from .types import TaskItem


def deep_merge(base: dict, overrides: dict) -> dict:
    """A new dict: `base` with `overrides` merged in recursively (dicts merge; anything else replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merge_overrides(row: dict, overrides: dict | None) -> dict:
    """A shallow copy of `row` whose `responses_create_params` has the job-level `overrides` deep-merged in
    (the override wins). The input row is not modified."""
    if not overrides:
        return row
    out = dict(row)
    out["responses_create_params"] = deep_merge(row.get("responses_create_params") or {}, overrides)
    return out


def materialize(rows: Iterable[tuple[int, dict[str, Any]]], num_repeats: int = 1) -> Iterator[TaskItem]:
    """TaskItems in NeMo Gym order (a a b b c c ...), lazily.

    `rows` yields (row_index, row). The task index is the row's own `_ng_task_index` when it carries
    one, else `row_index`; rollout indices run 0..num_repeats-1. The repeats share the row object
    (the engine never mutates it).
    """
    if num_repeats < 1:
        raise ValueError("num_repeats must be >= 1")
    for row_index, row in rows:
        task_index = row.get("_ng_task_index", row_index)
        try:
            task_index = int(task_index)
        except (TypeError, ValueError):
            raise ValueError(f"row {row_index}: _ng_task_index must be an integer, not {task_index!r}") from None
        for rollout_index in range(num_repeats):
            yield TaskItem(task_index=task_index, rollout_index=rollout_index, row=row)


def materialize_tasks(rows: Iterable[tuple[int, int, dict[str, Any]]], num_repeats: "int | Callable[[dict], int]" = 1
                      ) -> Iterator[TaskItem]:
    """TaskItems from stored rows that carry NeMo Gym's numbering: `rows` yields (task index, occurrence, row)
    and the row's rollouts are occurrence*R .. occurrence*R+R-1 (identical lines share a task index and
    continue its rollout count, as ng_collect_rollouts does; workers/task_index.py). `num_repeats`: R, or a
    function of the row (row_repeats: NeMo Gym's num_repeats per agent)."""
    if not callable(num_repeats) and num_repeats < 1:
        raise ValueError("num_repeats must be >= 1")
    for task_index, occurrence, row in rows:
        r = num_repeats(row) if callable(num_repeats) else num_repeats
        for rollout_index in rollout_indices(occurrence, r):
            yield TaskItem(task_index=task_index, rollout_index=rollout_index, row=row)


def with_seed(row: dict, rollout_index: int) -> dict:
    """NeMo Gym's num_repeats_add_seed: a copy of `row` whose responses_create_params.metadata.extra_body (a JSON
    string) carries "seed": the rollout index (vLLM model servers pass extra_body on to the model)."""
    import json

    rcp = dict(row.get("responses_create_params") or {})
    metadata = dict(rcp.get("metadata") or {})
    extra = json.loads(metadata.get("extra_body", "{}"))
    extra["seed"] = rollout_index
    metadata["extra_body"] = json.dumps(extra)
    rcp["metadata"] = metadata
    return {**row, "responses_create_params": rcp}


def row_repeats(num_repeats: int, options: dict | None) -> "int | Callable[[dict], int]":
    """R for every row, or, with NeMo Gym's per-agent num_repeats (options["repeats_by_agent"]:
    {agent: n, "_default": n}), a function of the row: its agent_ref's name, else options["default_agent"]."""
    by_agent = (options or {}).get("repeats_by_agent")
    if not by_agent:
        return num_repeats
    default_agent = (options or {}).get("default_agent")

    def repeats(row: dict) -> int:
        ref = row.get("agent_ref")
        name = (ref.get("name") if isinstance(ref, dict) else None) or default_agent
        n = by_agent.get(name, by_agent.get("_default"))
        if n is None:
            raise ValueError(f"num_repeats has no entry for agent {name!r} and no '_default'")
        return int(n)

    return repeats
