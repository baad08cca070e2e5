"""NeMo Gym materialization: repeats, task/rollout indices, job-level overrides.

Shared by the engine, the Django side (job chunks) and the CLI.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

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


def materialize_tasks(rows: Iterable[tuple[int, int, dict[str, Any]]], num_repeats: int = 1) -> Iterator[TaskItem]:
    """TaskItems from stored rows that carry NeMo Gym's numbering: `rows` yields (task index, occurrence, row)
    and the row's rollouts are occurrence*R .. occurrence*R+R-1 (identical lines share a task index and
    continue its rollout count, as ng_collect_rollouts does; workers/task_index.py)."""
    if num_repeats < 1:
        raise ValueError("num_repeats must be >= 1")
    for task_index, occurrence, row in rows:
        for rollout_index in rollout_indices(occurrence, num_repeats):
            yield TaskItem(task_index=task_index, rollout_index=rollout_index, row=row)
