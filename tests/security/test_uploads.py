"""Dataset uploads: repeated task indices are shared as NeMo Gym shares them, out-of-range ones are refused
with their line numbers, and a multipart upload larger than the in-memory limit (spooled to disk) works."""
from __future__ import annotations

import io
import json

from controlplane.datasets.models import Dataset

from .conftest import task_rows


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def test_repeated_task_index_is_shared_as_nemo_gym_shares_it(api):
    """NeMo Gym takes a repeated `_ng_task_index` and continues that task's rollout indices; the row keeps its
    occurrence, so no (task, rollout) pair is shared and nothing is lost (tests/controlplane/test_task_index.py)."""
    rows = task_rows(3)
    rows[0]["_ng_task_index"] = 5
    rows[1]["_ng_task_index"] = 7
    rows[2]["_ng_task_index"] = 5
    r = api.post("/api/datasets/?name=dup", data=_jsonl(rows), content_type="application/x-ndjson")
    assert r.status_code == 201, r.content
    ds = Dataset.objects.get(pk=r.json()["id"])
    assert list(ds.rows.order_by("index").values_list("task_index", "occurrence")) == [(5, 0), (7, 0), (5, 1)]


def test_null_task_index_refused_with_its_line(api):
    rows = task_rows(2)
    rows[1]["_ng_task_index"] = None
    r = api.post("/api/datasets/", data=_jsonl(rows), content_type="application/x-ndjson")
    assert r.status_code == 400 and r.json()["bad_lines"][0]["line"] == 2


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


def test_indexer_counts_occurrences_among_far_apart_and_dense_indices():
    from workers.task_index import TaskIndexer

    t = TaskIndexer()
    got = [t.assign({"_ng_task_index": i}, "") for i in [10**9, 5000, *range(3000), 5000, 10**9]]
    assert got[:2] == [(10**9, 0), (5000, 0)] and got[-2:] == [(5000, 1), (10**9, 1)]
    assert got[2:-2] == [(i, 0) for i in range(3000)]
    # lines without an index are numbered 0, 1... by first appearance, sharing the explicit 0 and 1 above
    assert t.assign({}, "x") == (0, 1) and t.assign({}, "y") == (1, 1) and t.assign({}, "x") == (0, 2)
