"""The CLI's output files (controlplane.jobs.outfiles) after a run killed at the worst moments: in the middle of
a line, and between a batch's commit and its write. Reopening cuts the torn line and appends only the stored
rollouts the file lacks; an earlier run's lines before the job's part are kept; the end holds one line each."""
from __future__ import annotations

import json

from controlplane.jobs.models import Rollout
from controlplane.jobs.outfiles import OutputFiles

from .test_export import export_job, insert_rollouts_sql  # noqa: F401  (fixture)


def keys(path, start=0):
    with open(path, "rb") as f:
        f.seek(start)
        return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in map(json.loads, f)]


def test_reopen_after_a_kill_mid_line_and_between_commit_and_write(export_job, tmp_path):  # noqa: F811
    job = export_job()
    insert_rollouts_sql(job, 10, repeats=2, fail_every=5)  # 20 stored: 16 ok, 4 failed (tasks 0 and 5)
    out = tmp_path / "rollouts.jsonl"
    earlier = '{"_ng_task_index": 0, "_ng_rollout_index": 0, "from": "an earlier run"}\n'
    out.write_text(earlier)  # another job's line: kept, never counted as this job's
    files = OutputFiles(job, out).open()
    assert files.start["output"] == len(earlier) and files.repaired == {"output": 16, "failures": 4}
    files.close()
    # the state of a killed run: 10 of the job's 16 lines, the 11th torn half-way
    text = out.read_text()
    lines = text[len(earlier):].splitlines(keepends=True)
    out.write_text(earlier + "".join(lines[:10]) + lines[10][: len(lines[10]) // 2])
    job.refresh_from_db()
    files = OutputFiles(job, out).open()  # the rerun
    assert files.repaired["output"] == 6 and files.repaired["failures"] == 0
    files.stored([])  # nothing new: the sink hands over only committed rows
    res = files.finish()
    assert out.read_text().startswith(earlier)
    mine = keys(out, len(earlier))
    stored = set(Rollout.objects.filter(job=job, status="ok").values_list("task_index", "rollout_index"))
    assert len(mine) == len(set(mine)) == 16 and set(mine) == stored and res["ok_rows"] == 16
    assert sorted(keys(out.with_name("rollouts_failures.jsonl"))) == [(t, r) for t in (0, 5) for r in (0, 1)]
