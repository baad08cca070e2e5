"""Dataset ingest: streaming validation, every bad line reported, reject-whole vs accept-partial."""
import hashlib
import io
import json
import os
import tracemalloc

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile, TemporaryUploadedFile
from django.core.management import call_command
from django.core.management.base import CommandError

from controlplane.datasets.models import Dataset, DatasetRow
from controlplane.datasets.services import (
    DatasetValidationError,
    delete_dataset,
    find_by_sha256,
    ingest_jsonl,
    iter_rows,
    preview_rows,
    split_into_chunks,
)
from workers import nemo_jsonl
from workers.nemo_jsonl import file_sha256, format_report, validate_jsonl

pytestmark = pytest.mark.django_db


def good(i=0, **extra):
    row = {"responses_create_params": {"input": [{"role": "user", "content": f"What is {i}+1?"}]},
           "question": f"What is {i}+1?", "expected_answer": str(i + 1)}
    row.update(extra)
    return json.dumps(row)


# One line per kind of defect; the expected reason fragment for each bad line.
BAD_FILE_LINES = [
    (good(0), None),
    ('{"responses_create_params": {"input": "hi"}', "not valid JSON"),  # truncated
    ("[1, 2, 3]", "must be a JSON object, got array"),
    ('{"question": "x"}', "missing 'responses_create_params'"),
    ('{"responses_create_params": "hello"}', "'responses_create_params' must be an object, got string"),
    ('{"responses_create_params": {}}', "input is missing"),
    ('{"responses_create_params": {"input": ""}}', "input is an empty string"),
    ('{"responses_create_params": {"input": []}}', "input is an empty list"),
    ('{"responses_create_params": {"input": 42}}', "must be a string or a list of messages, got number"),
    ('{"responses_create_params": {"input": [{"role": "robot", "content": "x"}]}}', "role must be one of"),
    ('{"responses_create_params": {"input": [{"role": "user", "content": 5}]}}', "content must be a string or a list of parts"),
    ('{"responses_create_params": {"input": [{"content": "x"}]}}', "has no 'role'"),
    ('{"responses_create_params": {"input": ["hi"]}}', "must be a message object, got string"),
    ('{"responses_create_params": {"input": "hi", "temperature": "hot"}}', "temperature must be a number, got string"),
    ('{"responses_create_params": {"input": "hi", "top_p": true}}', "top_p must be a number, got boolean"),
    ('{"responses_create_params": {"input": "hi", "max_output_tokens": -3}}', "max_output_tokens must be a positive integer"),
    ('{"responses_create_params": {"input": "hi", "max_output_tokens": 1.5}}', "max_output_tokens must be a positive integer"),
    ('{"responses_create_params": {"input": "hi", "tools": {}}}', "tools must be an array"),
    ('{"responses_create_params": {"input": "hi", "temperature": NaN}}', "not valid JSON"),
    ('{"responses_create_params": {"input": "hi"}, "score": 1e400}', "out of range"),
    ("", None),  # blank: skipped, not bad
    ("   ", None),  # whitespace only: skipped
    ('{"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "ok"}]}]}}', None),
    ('{"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}}', "text part without a string 'text'"),
    (good(1, agent_ref={"type": "responses_api_agents", "name": "x"}, extra_field=[1, 2]), None),
]


def write_lines(path, lines, raw_tail=b""):
    with open(path, "wb") as f:
        for text in lines:
            f.write(text.encode() + b"\n")
        f.write(raw_tail)
    return path


def test_every_bad_line_reported_with_number_and_reason(tmp_path):
    # plus an invalid UTF-8 line and a NUL escape at the end
    p = write_lines(tmp_path / "bad.jsonl", [t for t, _ in BAD_FILE_LINES],
                    raw_tail=b'{"responses_create_params": {"input": "caf\xe9"}}\n'
                             b'{"responses_create_params": {"input": "a\\u0000b"}}\n'
                             b'{"responses_create_params": {"input": "x\\ud800y"}}\n')
    with pytest.raises(DatasetValidationError) as ei:
        ingest_jsonl(p, name="bad")
    err = ei.value
    by_line = {b["line"]: b["reason"] for b in err.report["bad_lines"]}
    expected = {i + 1: frag for i, (_, frag) in enumerate(BAD_FILE_LINES) if frag}
    n = len(BAD_FILE_LINES)
    expected[n + 1] = "invalid UTF-8"
    expected[n + 2] = "NUL character"
    expected[n + 3] = "unpaired UTF-16 surrogate"
    assert set(by_line) == set(expected), (by_line, expected)
    for line, frag in expected.items():
        assert frag in by_line[line], (line, by_line[line], frag)
    # JSON errors say where
    assert "column" in by_line[2]
    assert err.report["bad_line_count"] == len(expected)
    assert err.report["blank_lines"] == 2
    assert err.report["truncated"] is False
    # rejected whole: stored with the report, no rows kept
    ds = err.dataset
    ds.refresh_from_db()
    assert ds.status == Dataset.Status.REJECTED
    assert ds.row_count == 0 and DatasetRow.objects.filter(dataset=ds).count() == 0
    assert ds.bad_line_count == len(expected)
    assert ds.validation_report["bad_lines"] == err.report["bad_lines"]
    text = format_report(err.report)
    assert "line 2: not valid JSON" in text
    # validate-only path agrees
    assert validate_jsonl(p)["bad_lines"] == err.report["bad_lines"]


def test_accept_partial_keeps_good_rows_with_line_numbers(tmp_path):
    p = write_lines(tmp_path / "bad.jsonl", [t for t, _ in BAD_FILE_LINES])
    ds = ingest_jsonl(p, name="partial", accept_partial=True)
    assert ds.status == Dataset.Status.READY
    good_lines = [i + 1 for i, (t, frag) in enumerate(BAD_FILE_LINES) if frag is None and t.strip()]
    assert ds.row_count == len(good_lines) == 3
    rows = list(DatasetRow.objects.filter(dataset=ds).order_by("index").values_list("index", "line_number"))
    assert rows == list(enumerate(good_lines))
    assert ds.validation_report["accepted_partial"] is True
    assert ds.bad_line_count == sum(1 for _, f in BAD_FILE_LINES if f)
    # unknown fields carried through
    last = list(iter_rows(ds))[-1][1]
    assert last["extra_field"] == [1, 2] and last["agent_ref"]["name"] == "x"


def test_clean_file_sha_size_rows_preview_chunks(tmp_path):
    lines = [good(i) for i in range(2500)]
    p = tmp_path / "ok.jsonl"
    # CRLF endings, a BOM, a trailing blank line and no final newline on the last row
    body = "\ufeff" + "\r\n".join(lines[:-1]) + "\r\n\r\n" + lines[-1]
    p.write_bytes(body.encode())
    raw = p.read_bytes()
    ds = ingest_jsonl(str(p), name="ok", batch_rows=1000)
    assert ds.status == "ready" and ds.row_count == 2500 and ds.bad_line_count == 0
    assert ds.sha256 == hashlib.sha256(raw).hexdigest()
    assert ds.size_bytes == len(raw)
    assert file_sha256(p) == (ds.sha256, len(raw))
    assert ds.validation_report["blank_lines"] == 1
    prev = preview_rows(ds, 3)
    assert [r["index"] for r in prev] == [0, 1, 2] and prev[0]["line_number"] == 1
    assert prev[2]["data"]["expected_answer"] == "3"
    assert list(DatasetRow.objects.filter(dataset=ds, index=2499).values_list("line_number", flat=True)) == [2501]
    assert split_into_chunks(ds, 1000) == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert split_into_chunks(ds, 1000, limit=1500) == [(0, 1000), (1000, 1500)]
    assert [i for i, _ in iter_rows(ds, 10, 13)] == [10, 11, 12]
    assert find_by_sha256(None, ds.sha256) == ds
    assert find_by_sha256(None, "0" * 64) is None


def test_uploaded_file_and_file_object_sources(tmp_path):
    data = ("\n".join(good(i) for i in range(50)) + "\n").encode()
    up = SimpleUploadedFile("tasks.jsonl", data, content_type="application/jsonl")
    ds = ingest_jsonl(up, name="upload")
    assert ds.row_count == 50 and ds.source_filename == "tasks.jsonl"
    ds2 = ingest_jsonl(io.BytesIO(data), name="bytes")
    assert ds2.sha256 == ds.sha256 == hashlib.sha256(data).hexdigest()
    tup = TemporaryUploadedFile("big.jsonl", "application/jsonl", len(data), None)
    tup.write(data)
    tup.flush()
    ds3 = ingest_jsonl(tup, name="tmpupload")
    assert ds3.row_count == 50
    tup.close()
    with pytest.raises(TypeError):
        ingest_jsonl(io.StringIO("x"), name="text")


def test_empty_file_and_all_bad_file_rejected_even_partial(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_bytes(b"\n\n")
    with pytest.raises(DatasetValidationError, match="empty"):
        ingest_jsonl(p, name="e", accept_partial=True)
    p.write_bytes(b"nope\n")
    with pytest.raises(DatasetValidationError, match="no valid rows"):
        ingest_jsonl(p, name="b", accept_partial=True)
    ds = ingest_jsonl(p, name="b2", raise_on_reject=False)
    assert ds.status == "rejected"


def test_report_list_capped_but_count_true(tmp_path, settings):
    p = write_lines(tmp_path / "many.jsonl", ["bad"] * (nemo_jsonl.MAX_REPORTED_BAD_LINES + 25) + [good(0)])
    with pytest.raises(DatasetValidationError) as ei:
        ingest_jsonl(p, name="many")
    rep = ei.value.report
    assert len(rep["bad_lines"]) == nemo_jsonl.MAX_REPORTED_BAD_LINES
    assert rep["bad_line_count"] == nemo_jsonl.MAX_REPORTED_BAD_LINES + 25
    assert rep["truncated"] is True
    assert ei.value.dataset.bad_line_count == nemo_jsonl.MAX_REPORTED_BAD_LINES + 25


def test_line_spanning_many_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(nemo_jsonl, "READ_CHUNK_BYTES", 7)  # lines cross chunk boundaries everywhere
    lines = [good(i) for i in range(30)] + ["{broken"] + [good(99)]
    p = write_lines(tmp_path / "x.jsonl", lines)
    ds = ingest_jsonl(p, name="x", accept_partial=True)
    assert ds.row_count == 31
    assert ds.validation_report["bad_lines"][0]["line"] == 31
    assert list(iter_rows(ds, 30, 31))[0][1]["expected_answer"] == "100"
    monkeypatch.setattr(nemo_jsonl, "MAX_LINE_BYTES", 200)
    p2 = write_lines(tmp_path / "long.jsonl", [good(1), json.dumps({"responses_create_params": {"input": "y" * 500}}), good(2)])
    with pytest.raises(DatasetValidationError) as ei:
        ingest_jsonl(p2, name="long")
    assert ei.value.report["bad_lines"] == [{"line": 2, "reason": "line is longer than 200 bytes"}]


def test_delete_dataset(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [good(i) for i in range(10)])
    ds = ingest_jsonl(p, name="d")
    delete_dataset(ds)
    assert not Dataset.objects.filter(pk=ds.pk).exists()
    assert DatasetRow.objects.count() == 0


def test_load_dataset_command(tmp_path, capsys):
    p = write_lines(tmp_path / "cmd.jsonl", [good(0), "{oops", good(1), '{"responses_create_params": {"input": []}}'])
    with pytest.raises(CommandError) as ei:
        call_command("load_dataset", str(p))
    assert ei.value.returncode == 1
    err = capsys.readouterr().err
    assert "line 2: not valid JSON" in err and "line 4: responses_create_params.input is an empty list" in err
    out = io.StringIO()
    call_command("load_dataset", str(p), "--accept-partial", "--name", "cmdok", stdout=out)
    assert "2 rows" in out.getvalue() and "line 2:" in out.getvalue()
    assert Dataset.objects.get(name="cmdok").row_count == 2


def _gen_file(path, n):
    with open(path, "wb") as f:
        for i in range(n):
            f.write(b'{"responses_create_params": {"input": [{"role": "user", "content": "What is %d + %d?"}]}, '
                    b'"question": "What is %d + %d?", "expected_answer": "%d"}\n' % (i, i, i, i, 2 * i))
    return path


def _ingest_peak(path, name):
    tracemalloc.start()
    try:
        ds = ingest_jsonl(path, name=name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return ds, peak


@pytest.mark.slow
def test_streaming_ingest_memory_is_bounded(tmp_path, monkeypatch):
    """Peak Python allocation while ingesting 10k rows vs 100k rows: flat (batches of 1000) once both files are
    past the bound of rows numbered in memory; below it, the numbering's memory grows by at most ~130 bytes a
    row (its line digests)."""
    from controlplane.datasets.services import _RowWriter

    small = _gen_file(tmp_path / "small.jsonl", 10_000)
    big = _gen_file(tmp_path / "big.jsonl", 100_000)
    bound = _RowWriter.NUMBER_IN_MEMORY_MAX_ROWS
    ds_d, peak_d = _ingest_peak(big, "big, default bound")
    monkeypatch.setattr(_RowWriter, "NUMBER_IN_MEMORY_MAX_ROWS", 5_000)
    ds_s, peak_s = _ingest_peak(small, "small")
    ds_b, peak_b = _ingest_peak(big, "big")
    size_b = os.path.getsize(big)
    print(f"\ningest peak: 10k rows {peak_s / 2**20:.1f} MiB; 100k rows ({size_b / 2**20:.1f} MiB file) {peak_b / 2**20:.1f} "
          f"MiB, numbered in memory {peak_d / 2**20:.1f} MiB")
    assert ds_b.row_count == ds_d.row_count == 100_000 and ds_s.row_count == 10_000
    assert ds_b.sha256 == file_sha256(big)[0]
    assert peak_b < 1.5 * peak_s + 2 * 2**20, (peak_s, peak_b)
    assert peak_b < size_b / 2
    assert peak_d - peak_b < 160 * min(bound, 100_000), (peak_b, peak_d)  # at most ~16 MB


def test_a_csv_or_json_array_upload_is_named_as_such(tmp_path):
    p = tmp_path / "data.csv"
    p.write_bytes(b"question,expected_answer\nWhat is 1+1?,2\nWhat is 2+2?,4\n")
    with pytest.raises(DatasetValidationError, match="looks like CSV, not JSON Lines") as ei:
        ingest_jsonl(p, name="csv")
    assert "looks like CSV" in ei.value.report["message"]
    p = tmp_path / "data.json"
    p.write_bytes(json.dumps([{"question": "q"}, {"question": "r"}], indent=2).encode())
    with pytest.raises(DatasetValidationError, match="JSON array, not JSON Lines"):
        ingest_jsonl(p, name="arr")
    p = tmp_path / "fine-but-bad.jsonl"  # JSON Lines with a bad row: no format hint
    p.write_bytes(b'{"x": 1}\n')
    with pytest.raises(DatasetValidationError) as ei:
        ingest_jsonl(p, name="x")
    assert "looks like" not in str(ei.value)
