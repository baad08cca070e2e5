"""Dataset uploads: repeated or out-of-range task indices are refused with their line numbers (no rollout
is silently lost later), and a multipart upload larger than the in-memory limit (spooled to disk) works."""
from __future__ import annotations

import io
import json

from controlplane.datasets.models import Dataset

from .conftest import task_rows


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def test_repeated_task_index_refused_with_both_line_numbers(api):
    rows = task_rows(3)
    rows[0]["_ng_task_index"] = 5
    rows[1]["_ng_task_index"] = 7
    rows[2]["_ng_task_index"] = 5
    r = api.post("/api/datasets/?name=dup", data=_jsonl(rows), content_type="application/x-ndjson")
    assert r.status_code == 400, r.content
    body = r.json()
    assert body["bad_line_count"] == 1
    assert body["bad_lines"] == [{"line": 3, "reason": "task index 5 (_ng_task_index) repeats the task index of line 1"}]
    assert not Dataset.objects.filter(status=Dataset.Status.READY).exists()


def test_explicit_index_clashing_with_a_positional_one(api):
    rows = task_rows(3)
    rows[2]["_ng_task_index"] = 1  # row 1 (line 2) has task index 1 by position
    r = api.post("/api/datasets/?name=dup&accept_partial=true", data=_jsonl(rows), content_type="application/x-ndjson")
    assert r.status_code == 201, r.content
    assert r.json()["row_count"] == 2 and r.json()["validation_report"]["bad_lines"][0]["line"] == 3


def test_task_index_beyond_32_bits_refused_at_upload(api):
    rows = task_rows(2)
    rows[1]["_ng_task_index"] = 2**31
    r = api.post("/api/datasets/", data=_jsonl(rows), content_type="application/x-ndjson")
    assert r.status_code == 400 and r.json()["bad_lines"][0]["line"] == 2
    assert "2147483647" in r.json()["bad_lines"][0]["reason"]


def test_multipart_upload_over_the_in_memory_limit(api, settings):
    rows = task_rows(3)
    pad = "y" * (1024 * 1024)
    for r in rows:
        r["padding"] = pad  # 3 x 1 MiB: spooled to a temporary file
    blob = _jsonl(rows)
    assert len(blob) > settings.FILE_UPLOAD_MAX_MEMORY_SIZE
    f = io.BytesIO(blob)
    f.name = "big.jsonl"
    r = api.post("/api/datasets/", {"file": f, "name": "big"}, format="multipart")
    assert r.status_code == 201, r.content[:500]
    assert r.json()["row_count"] == 3 and r.json()["size_bytes"] == len(blob)


def test_tracker_finds_repeats_among_far_apart_and_dense_indices():
    from workers.task_index import TaskIndexTracker

    t = TaskIndexTracker()
    seen = [t.check({"_ng_task_index": i}, pos, pos + 1) for pos, i in enumerate([10**9, 5000, *range(3000), 5000])]
    assert seen[:-1] == [None] * 3002
    assert seen[-1] == "task index 5000 (_ng_task_index) repeats the task index of line 2"
    assert t.check({}, 10**9, 99) == "task index 1000000000 (its position) repeats the task index of line 1"
