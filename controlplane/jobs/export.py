"""Export a job's rollouts as NeMo Gym JSONL, streamed in constant memory.

- `iter_export_lines(job, which="ok"|"failed"|"all")` yields one JSON line (with its "\\n") per rollout,
  ordered by (task_index, rollout_index), read through a server-side cursor (PostgreSQL) in chunks, so
  memory does not grow with the job's size. The stored `data` column is the NeMo Gym output row; failed
  rows additionally carry `failure_class` and `error` (as NeMo Gym's `_failures.jsonl` does).
- `write_export(job, path)` writes `<out>.jsonl`, `<out>_failures.jsonl` and
  `<out>_aggregate_metrics.json` beside each other (NeMo Gym's names: `rollouts.jsonl` ->
  `rollouts_failures.jsonl`, `rollouts_aggregate_metrics.json`), each through a temporary file renamed
  into place, so a reader never sees a half-written file.
- Curated exports (`curate`): a reward range, tasks whose rewards are all equal left out, a version-lag bound and
  failure classes, all applied in the query (the stream of lines stays constant-memory).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import AsyncIterator, Iterator

from django.db import connection
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db.models import TextField
from django.db.models.functions import Cast

from .models import CollectionJob, Rollout
from .stream import current_version, lag_of

EXPORT_CHUNK_ROWS = 2000


def _dumps(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def curate(qs, job, *, reward_min=None, reward_max=None, skip_equal=False, max_lag=None, failure_classes=None):
    """`qs` (a job's rollouts) narrowed for a curated export: reward in [reward_min, reward_max] (rows without a
    reward left out when a bound is given); skip_equal: leave out the tasks whose ok rollouts (two or more) all have
    the same reward (no signal for a group-relative advantage); max_lag: leave out rows whose weight version is more
    than max_lag versions behind the endpoint's current one, and rows marked stale (an untagged row is kept, as
    the stream keeps it); failure_classes: failed rows only of these classes (ok rows are not affected)."""
    from django.db.models import Count, F, Max, Min, Q

    job_id = getattr(job, "pk", job)
    if reward_min is not None:
        qs = qs.filter(reward__gte=reward_min)
    if reward_max is not None:
        qs = qs.filter(reward__lte=reward_max)
    if skip_equal:
        equal = (Rollout.objects.filter(job_id=job_id, status=Rollout.Status.OK, reward__isnull=False)
                 .values("task_index").annotate(n=Count("id"), lo=Min("reward"), hi=Max("reward"))
                 .filter(n__gt=1, lo=F("hi")).values("task_index"))
        qs = qs.exclude(task_index__in=equal)
    if max_lag is not None:
        endpoint_id = getattr(job, "endpoint_id", None)
        if endpoint_id is None:
            endpoint_id = CollectionJob.objects.filter(pk=job_id).values_list("endpoint_id", flat=True).first()
        current = current_version(endpoint_id)
        versions = Rollout.objects.filter(job_id=job_id).values_list("weight_version", flat=True).distinct()
        past = [v for v in versions if (lag := lag_of(v, current)) is not None and v and lag > max_lag]
        qs = qs.exclude(weight_version__in=past).exclude(stale=True)
    if failure_classes:
        qs = qs.filter(Q(status=Rollout.Status.OK) | Q(failure_class__in=list(failure_classes)))
    return qs


def iter_export_rows(job, which: str = "ok", chunk_size: int = EXPORT_CHUNK_ROWS, error_view=None,
                     filters: dict | None = None, exclude_worker: str | None = None) -> Iterator[dict]:
    """The NeMo Gym output rows of the job (dicts), in (task_index, rollout_index) order. `error_view(text)`: a
    failed row's error as the reader may see it (controlplane.disclosure.error_for; None: as stored). `filters`:
    curate()'s keywords. `exclude_worker`: leave out the rows stored by that worker (the outfiles' rows imported
    from a file)."""
    if which not in ("ok", "failed", "all"):
        raise ValueError("which must be 'ok', 'failed' or 'all'")
    qs = Rollout.objects.filter(job_id=getattr(job, "pk", job))
    if exclude_worker is not None:
        qs = qs.exclude(worker=exclude_worker)
    if which != "all":
        qs = qs.filter(status=Rollout.Status.OK if which == "ok" else Rollout.Status.FAILED)
    if filters:
        qs = curate(qs, job, **filters)
    qs = qs.order_by("task_index", "rollout_index").values_list(
        "task_index", "rollout_index", "status", "failure_class", "error", "data", "weight_version")
    for task_index, rollout_index, status, failure_class, error, data, wv in qs.iterator(chunk_size=chunk_size):
        yield export_row(task_index, rollout_index, status, failure_class, error, data, wv, error_view)


def export_row(task_index, rollout_index, status, failure_class, error, data, weight_version, error_view=None) -> dict:
    """One rollout as its NeMo Gym output row (what a line of the export holds)."""
    row = dict(data) if isinstance(data, dict) else {"data": data}
    row.setdefault("_ng_task_index", task_index)
    row.setdefault("_ng_rollout_index", rollout_index)
    if weight_version:
        row.setdefault("weight_version", weight_version)
    if status == Rollout.Status.FAILED:
        row["failure_class"] = failure_class
        row["error"] = error_view(error) if error_view is not None else error
    return row


def iter_export_lines(job, which: str = "ok", chunk_size: int = EXPORT_CHUNK_ROWS, error_view=None,
                      filters: dict | None = None) -> Iterator[str]:
    """One JSONL line (ending in newline) per rollout; see the module docstring. `filters`: curate()'s keywords.

    On PostgreSQL, successful rows are streamed as jsonb's own text (no decode/encode round trip in
    Python) whenever they already carry their `_ng_*` indices, as the engine's rows do."""
    if which == "ok" and connection.vendor == "postgresql":
        yield from _iter_ok_lines_pg(job, chunk_size, filters)
        return
    for row in iter_export_rows(job, which, chunk_size, error_view, filters):
        yield _dumps(row)


def _iter_ok_lines_pg(job, chunk_size: int, filters: dict | None = None) -> Iterator[str]:
    qs = Rollout.objects.filter(job_id=getattr(job, "pk", job), status=Rollout.Status.OK)
    if filters:
        qs = curate(qs, job, **filters)
    qs = (qs.order_by("task_index", "rollout_index")
          .annotate(text=Cast("data", output_field=TextField()))
          .values_list("task_index", "rollout_index", "text", "weight_version"))
    for task_index, rollout_index, text, wv in qs.iterator(chunk_size=chunk_size):
        if '"_ng_task_index"' in text and '"_ng_rollout_index"' in text and "\n" not in text:
            if wv and text.endswith("}") and '"weight_version"' not in text:
                yield text[:-1] + ', "weight_version": ' + json.dumps(wv) + "}\n"  # the rollout's weight version
            else:
                yield text + "\n"
        else:
            row = json.loads(text)
            if not isinstance(row, dict):
                row = {"data": row}
            row.setdefault("_ng_task_index", task_index)
            row.setdefault("_ng_rollout_index", rollout_index)
            if wv:
                row.setdefault("weight_version", wv)
            yield _dumps(row)


class _SyncBody:
    """An async iterator over a sync one, each step run by sync_to_async on the one thread that serves
    this request's synchronous code (the server-side cursor, a streamed take's transaction, live on that thread's
    connection).

    Under ASGI, Django serves a *sync* StreamingHttpResponse iterator by listing it whole first; this
    one is consumed chunk by chunk as the client reads. `close` closes the sync iterator: Django calls it with the
    response's close, on the request's thread and before the request's connection goes back to the pool (a client
    gone mid-body: its transaction is rolled back there). Closing only from the async iterator's own `finally`
    left that to whenever the event loop finalized it, in another context, when Django's wrapping iterator was
    closed without it: a take's transaction then outlived its request on a connection already returned."""

    def __init__(self, iterator: Iterator):
        self._it = iter(iterator)

    def __aiter__(self) -> AsyncIterator:
        return self._chunks()

    async def _chunks(self):
        step = sync_to_async(next, thread_sensitive=True)
        done = object()
        try:
            while True:
                chunk = await step(self._it, done)
                if chunk is done:
                    return
                yield chunk
        finally:  # not closed by the response yet (a closed generator's close does nothing)
            await sync_to_async(self.close, thread_sensitive=True)()

    def close(self) -> None:
        if hasattr(self._it, "close"):
            self._it.close()


def aiter_sync(iterator: Iterator) -> _SyncBody:
    return _SyncBody(iterator)


def streamed_for(request, iterator: Iterator):
    """The body iterator a StreamingHttpResponse should get for this request: async under ASGI (so it is
    streamed, not listed first), the sync iterator itself under WSGI or the test client."""
    if isinstance(getattr(request, "_request", request), ASGIRequest):
        return aiter_sync(iterator)
    return iterator


def export_paths(path: str | os.PathLike) -> dict[str, Path]:
    """{"output", "failures", "aggregate_metrics"} paths for an output path, NeMo Gym style."""
    p = Path(path)
    suffix = p.suffix or ".jsonl"
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    return {
        "output": p if p.suffix else p.with_name(stem + suffix),
        "failures": p.with_name(f"{stem}_failures{suffix}"),
        "aggregate_metrics": p.with_name(f"{stem}_aggregate_metrics.json"),
    }


def _write_atomic_lines(path: Path, lines: Iterator[str]) -> int:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8", buffering=1 << 20) as f:
            for line in lines:
                f.write(line)
                n += 1
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return n


def write_export(job, path: str | os.PathLike, *, failures: bool = True, aggregate_metrics: bool = True) -> dict:
    """Write the job's rollouts (`path`), failures and aggregate metrics beside it.
    Returns {"output": str, "failures": str|None, "aggregate_metrics": str|None, "ok_rows": n, "failed_rows": n}."""
    paths = export_paths(path)
    paths["output"].parent.mkdir(parents=True, exist_ok=True)
    result = {"output": str(paths["output"]), "failures": None, "aggregate_metrics": None}
    result["ok_rows"] = _write_atomic_lines(paths["output"], iter_export_lines(job, "ok"))
    result["failed_rows"] = 0
    if failures:
        result["failed_rows"] = _write_atomic_lines(paths["failures"], iter_export_lines(job, "failed"))
        result["failures"] = str(paths["failures"])
    if aggregate_metrics:
        result["aggregate_metrics"] = write_aggregate_metrics(job, path)
    return result


def write_aggregate_metrics(job, path: str | os.PathLike) -> str:
    """`<out>_aggregate_metrics.json` beside the output path; returns its path."""
    target = export_paths(path)["aggregate_metrics"]
    metrics = dict(job.aggregate_metrics or {})
    if "nemo_gym_agents" in metrics:  # a NeMo Gym agent job: the agents' own entries, NeMo Gym's shape
        metrics = metrics["nemo_gym_agents"]
    _write_atomic_lines(target, iter([json.dumps(metrics, indent=2, sort_keys=True) + "\n"]))
    return str(target)
