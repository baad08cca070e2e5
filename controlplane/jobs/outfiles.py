"""The CLI's output files, NeMo Gym style, growing while the job runs.

NeMo Gym's ng_collect_rollouts appends each rollout to `<out>.jsonl` (a failure to `<out>_failures.jsonl`) and
flushes as it arrives: `wc -l` shows the progress and a killed run leaves every finished rollout on disk.
OutputFiles does the same for a job, from its table:

- `open()` finds the job's lines in each file: they begin at the offset kept in `job.output_files`; a job new to
  the file begins at its end, so lines an earlier run wrote stay (the `tail -n +N` recipe of NeMo Gym's docs
  appends). A torn last line (a run killed in the middle of a write) is cut off, and the stored rollouts the file
  lacks (a run killed between a batch's commit and its write, or a file deleted) are appended.
- `stored(rows)` is the DbSink's `on_stored`: each batch's newly committed rows are appended and flushed at once,
  so the files hold the stored rollouts, no more, at any moment.
- `finish()` checks that the job's part of each file is exactly its stored rollouts, one line each, and rewrites
  that part from the table otherwise (and when rewards were written after collection: fast / deferred verify).

`+resume_from_cache` (`whole_file`), as nemo-gym 0.4.0's run_from_config: every line of `<out>.jsonl` is a
rollout done (imported into the job), so the job's part of it is the whole file. `<out>_failures.jsonl` is NeMo
Gym's attempt ledger: one line per failed rollout per run, appended and never rewritten (its resume counts the
lines of a rollout to stop retrying it after NEMO_GYM_MAX_ROLLOUT_ATTEMPTS). Its earlier lines stay; the job's
part is after them and holds this run's failures only, not the failed rollouts imported from it
(worker IMPORTED). When the same job resumes from the cache again (dropin.retry_from_ledger), its part of the
ledger begins at the file's end and holds the failed rollouts stored after `after_pk` only.

A failure the agent marks `_ng_no_persist` (NeMo Gym's kill-shaped failures) is written to neither file, as NeMo
Gym writes it nowhere: the job keeps it as a failed rollout, and a resume from the cache collects it again.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from .export import EXPORT_CHUNK_ROWS, export_paths, export_row
from .models import CollectionJob, Rollout

KINDS = (("output", Rollout.Status.OK), ("failures", Rollout.Status.FAILED))
IMPORTED = "resume_from_cache"  # the worker of a rollout dropin.import_cache took from the output files
NO_PERSIST = "_ng_no_persist"


def _dumps(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False) + "\n"


def _line_key(line: bytes):
    try:
        row = json.loads(line)
        return row["_ng_task_index"], row["_ng_rollout_index"]
    except (ValueError, KeyError, TypeError):
        return None


def _segment(path: Path, start: int) -> tuple[int, bool]:
    """(complete lines from `start`, whether a torn last line was cut off)."""
    if not path.exists():
        return 0, False
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(1 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    if last != b"\n":  # killed in the middle of a line: keep the file's complete lines only
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            pos = size
            while pos > start:
                step = min(1 << 16, pos - start)
                f.seek(pos - step)
                chunk = f.read(step)
                i = chunk.rfind(b"\n")
                if i >= 0:
                    pos = pos - step + i + 1
                    break
                pos -= step
            f.truncate(max(pos, start))
        return n, True
    return n, False


def _segment_keys(path: Path, start: int) -> set:
    keys = set()
    with open(path, "rb") as f:
        f.seek(start)
        for line in f:
            if (k := _line_key(line)) is not None:
                keys.add(k)
    return keys


class OutputFiles:
    """A job's `<out>.jsonl` and `<out>_failures.jsonl` (module docstring). `whole_file`: every line already in
    the files is the job's (+resume_from_cache: NeMo Gym's resume reads the whole file)."""

    def __init__(self, job, path, *, whole_file: bool = False):
        self.job = job
        self.paths = export_paths(path)
        self.whole_file = whole_file
        self.start: dict[str, int] = {}
        self.earlier: dict[str, int] = {}  # bytes before the job's part (an earlier run's lines)
        self.files: dict = {}
        self.lines: dict[str, int] = {"output": 0, "failures": 0}
        self.repaired: dict[str, int] = {"output": 0, "failures": 0}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ open
    def open(self) -> "OutputFiles":
        state = dict(self.job.output_files or {})
        self.paths["output"].parent.mkdir(parents=True, exist_ok=True)
        for kind, _status in KINDS:
            path = self.paths[kind]
            where = os.path.abspath(path)
            size = path.stat().st_size if path.exists() else 0
            mine = state.get(kind) or {}
            if self.whole_file and kind == "output":
                start = 0
            elif mine.get("path") == where and 0 <= int(mine.get("start", -1)) <= size:
                start = int(mine["start"])
            else:  # the job's first lines in this file: after whatever is there
                start = size
            self.start[kind] = start
            self.earlier[kind] = start
            n, _torn = _segment(path, start)
            stored = self._stored(kind).count()
            if n < stored:  # rows stored but not written (killed between commit and write, or a file deleted)
                keys = _segment_keys(path, start) if n else set()
                with open(path, "a", encoding="utf-8") as f:
                    for row in self._rows(kind):
                        if (row["_ng_task_index"], row["_ng_rollout_index"]) not in keys:
                            f.write(_dumps(row))
                            self.repaired[kind] += 1
                n += self.repaired[kind]
            self.lines[kind] = n
            state[kind] = {**(mine if mine.get("path") == where else {}), "path": where, "start": start}
            self.files[kind] = open(path, "a", encoding="utf-8")
        CollectionJob.objects.filter(pk=self.job.pk).update(output_files=state)
        self.job.output_files = state
        return self

    def _stored(self, kind: str):
        """The job's rollouts that belong in its part of the file `kind`: under resume_from_cache, not the failed
        rollouts imported from the failures ledger (their lines are there already, before the job's part), nor
        those stored before a resume from the cache rebased the part (`after_pk`); never a `_ng_no_persist` one."""
        qs = Rollout.objects.filter(job=self.job, status=dict(KINDS)[kind])
        if kind != "failures":
            return qs
        after = ((self.job.output_files or {}).get("failures") or {}).get("after_pk")
        if after is not None:
            qs = qs.filter(pk__gt=after)
        if self.whole_file or after is not None:
            qs = qs.exclude(worker=IMPORTED)
        unwritten = Rollout.objects.filter(job=self.job, status=Rollout.Status.FAILED, data___ng_no_persist=True)
        return qs.exclude(pk__in=unwritten.values("pk"))

    def _rows(self, kind: str):
        qs = self._stored(kind).order_by("task_index", "rollout_index").values_list(
            "task_index", "rollout_index", "status", "failure_class", "error", "data", "weight_version")
        for values in qs.iterator(chunk_size=EXPORT_CHUNK_ROWS):
            yield export_row(*values)

    # ----------------------------------------------------------------------------------- streaming
    def stored(self, rows: list[dict]) -> None:
        """DbSink.on_stored: append the batch's rows (dicts of sink._rollout_values) and flush."""
        by_kind: dict[str, list[str]] = {"output": [], "failures": []}
        for r in rows:
            if r["status"] != Rollout.Status.OK and isinstance(r["data"], dict) and r["data"].get(NO_PERSIST):
                continue  # NeMo Gym writes a kill-shaped failure nowhere (module docstring)
            row = export_row(r["task_index"], r["rollout_index"], r["status"], r["failure_class"], r["error"],
                             r["data"], r["weight_version"])
            by_kind["output" if r["status"] == Rollout.Status.OK else "failures"].append(_dumps(row))
        with self._lock:
            for kind, lines in by_kind.items():
                if lines and kind in self.files:
                    f = self.files[kind]
                    f.write("".join(lines))
                    f.flush()
                    self.lines[kind] += len(lines)

    # --------------------------------------------------------------------------------------- finish
    def close(self) -> None:
        with self._lock:
            for f in self.files.values():
                f.close()
            self.files = {}

    def finish(self, *, rewrite: bool = False) -> dict:
        """Close the files; make the job's part of each exactly its stored rollouts (module docstring).
        Returns {"output", "failures", "ok_rows", "failed_rows", "earlier_bytes"}."""
        self.close()
        result = {"output": str(self.paths["output"]), "failures": str(self.paths["failures"]),
                  "earlier_bytes": dict(self.earlier)}
        for kind, _status in KINDS:
            path, start = self.paths[kind], self.start[kind]
            n, _ = _segment(path, start)
            stored = self._stored(kind).count()
            if rewrite or n != stored or not path.exists():
                with open(path, "a+b") as f:
                    f.truncate(start)
                with open(path, "a", encoding="utf-8") as f:
                    n = 0
                    for row in self._rows(kind):
                        f.write(_dumps(row))
                        n += 1
            result["ok_rows" if kind == "output" else "failed_rows"] = n
        return result
