"""Upload-time checks of the fields verifiers read: every upload records which verifiers its rows can
serve (rows lacking each one's fields, with their line numbers); an upload *for* a verifier treats a row
lacking its fields as a bad line (rejected, or skipped with accept_partial). Streaming stays bounded."""
from __future__ import annotations

import io
import json
import re
import tracemalloc

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse

from controlplane.datasets.models import Dataset, DatasetRow
from controlplane.datasets.services import DatasetValidationError, ingest_jsonl
from tests.factories import jsonl_bytes, make_user

pytestmark = pytest.mark.django_db


def mcq(i, **drop):
    row = {"responses_create_params": {"input": f"Question {i}? A) x B) y"}, "question": f"Question {i}?",
           "options": [{"A": "x"}, {"B": "y"}], "expected_answer": "A"}
    for key in drop:
        row.pop(key)
    return row


# lines 1..8; line 3 lacks options, line 5 lacks expected_answer, line 7 lacks both
ROWS = [mcq(1), mcq(2), mcq(3, options=1), mcq(4), mcq(5, expected_answer=1), mcq(6), mcq(7, options=1, expected_answer=1),
        mcq(8)]


def _file(rows, tmp_path, name="mcq.jsonl"):
    path = tmp_path / name
    path.write_bytes(jsonl_bytes(rows))
    return path


def test_every_upload_records_which_verifiers_fit_with_line_numbers(tmp_path):
    ds = ingest_jsonl(_file(ROWS, tmp_path), name="mcq")
    fit = ds.validation_report["verifiers"]
    assert fit["mcqa"] == {"required": ["options", "expected_answer"], "fits": False, "lacking_rows": 3,
                           "lines": [3, 5, 7], "missing": {"options": 2, "expected_answer": 2}}
    assert fit["math"]["lacking_rows"] == 2 and fit["math"]["lines"] == [5, 7]
    assert fit["code"]["lacking_rows"] == 8 and fit["code"]["missing"] == {"verifier_metadata.unit_tests": 8}
    assert fit["judge"]["lines"] == [5, 7] and "none" not in fit  # the judge's default template names expected_answer
    summary = ds.validation_report["verifier_fit"]
    assert summary.startswith("fits verifiers: none;")
    assert "mcqa needs options, expected_answer (missing in lines 3, 5, 7; 3 rows)" in summary
    # only the first lines are kept, the count stays true
    many = [mcq(i, options=1) for i in range(45)]
    fit = ingest_jsonl(_file(many, tmp_path, "many.jsonl"), name="many").validation_report["verifiers"]["mcqa"]
    assert fit["lacking_rows"] == 45 and fit["lines"] == list(range(1, 21))
    assert "mcqa needs options (missing in lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, …; 45 rows)" \
        in ingest_jsonl(_file(many, tmp_path, "m2.jsonl"), name="m2").validation_report["verifier_fit"]


def test_upload_for_a_verifier_rejects_rows_lacking_its_fields_by_line(tmp_path):
    with pytest.raises(DatasetValidationError) as err:
        ingest_jsonl(_file(ROWS, tmp_path), name="for mcqa", verifier="mcqa")
    assert err.value.bad_lines == [
        {"line": 3, "reason": "lacks options, which verifier 'mcqa' needs"},
        {"line": 5, "reason": "lacks expected_answer, which verifier 'mcqa' needs"},
        {"line": 7, "reason": "lacks options, expected_answer, which verifier 'mcqa' needs"}]
    assert err.value.dataset.status == "rejected" and not DatasetRow.objects.filter(dataset=err.value.dataset).exists()
    assert err.value.dataset.validation_report["verifier"] == "mcqa"
    # accept_partial keeps the rows the verifier can score; the dataset then fits it
    ds = ingest_jsonl(_file(ROWS, tmp_path), name="partial", verifier="mcqa", accept_partial=True)
    assert ds.row_count == 5 and ds.bad_line_count == 3
    assert list(DatasetRow.objects.filter(dataset=ds).values_list("line_number", flat=True)) == [1, 2, 4, 6, 8]
    assert ds.validation_report["verifiers"]["mcqa"]["fits"]
    # a verifier by dotted path (the operator's: load_dataset), and an unknown one (nothing stored)
    ds = ingest_jsonl(_file(ROWS, tmp_path), name="plugin", verifier="tests.verifier_plugins.Length", operator=True)
    assert ds.row_count == 8 and ds.validation_report["verifiers"]["tests.verifier_plugins.Length"]["fits"]
    before = Dataset.objects.count()
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        ingest_jsonl(_file(ROWS, tmp_path), name="x", verifier="nope")
    assert Dataset.objects.count() == before


def test_load_dataset_command_takes_a_verifier(tmp_path, capsys):
    with pytest.raises(CommandError):
        call_command("load_dataset", str(_file(ROWS, tmp_path)), "--verifier", "mcqa")
    err = capsys.readouterr().err
    assert "line 3: lacks options, which verifier 'mcqa' needs" in err and "line 7:" in err
    call_command("load_dataset", str(_file(ROWS, tmp_path)), "--verifier", "math", "--accept-partial")
    out = capsys.readouterr().out
    assert "6 rows" in out and "fits verifiers: " in out and "math" in out.split("fits verifiers: ")[1].split(";")[0]


def test_api_upload_for_a_verifier(tmp_path):
    from rest_framework.test import APIClient

    user = make_user("fit-api", token=True)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {user.api_token}")
    f = io.BytesIO(jsonl_bytes(ROWS))
    f.name = "mcq.jsonl"
    r = api.post("/api/datasets/", {"file": f, "verifier": "mcqa"}, format="multipart")
    assert r.status_code == 400, r.content
    assert [b["line"] for b in r.json()["bad_lines"]] == [3, 5, 7]
    r = api.post("/api/datasets/?verifier=math&accept_partial=true", data=jsonl_bytes(ROWS),
                 content_type="application/x-ndjson")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["row_count"] == 6 and body["validation_report"]["verifiers"]["math"]["fits"]
    assert body["validation_report"]["verifiers"]["mcqa"]["lines"] == [3]
    r = api.post("/api/datasets/?verifier=nope", data=jsonl_bytes(ROWS), content_type="application/x-ndjson")
    assert r.status_code == 400 and "unknown verifier 'nope'" in json.dumps(r.json())


def test_dataset_page_shows_the_fit_and_the_upload_form_takes_a_verifier(tmp_path):
    user = make_user("fit-page", "fit-page-pw-1")
    c = Client()
    c.force_login(user)
    f = io.BytesIO(jsonl_bytes(ROWS))
    f.name = "mcq.jsonl"
    r = c.post(reverse("dashboard:dataset_upload"), {"file": f, "verifier": "mcqa"}, HTTP_ACCEPT="application/json")
    assert r.status_code == 400 and [b["line"] for b in r.json()["report"]["bad_lines"]] == [3, 5, 7]
    f = io.BytesIO(jsonl_bytes(ROWS))
    f.name = "mcq.jsonl"
    r = c.post(reverse("dashboard:dataset_upload"), {"file": f, "verifier": "nope"}, HTTP_ACCEPT="application/json")
    assert r.status_code == 400 and "verifier: unknown verifier 'nope'" in r.json()["message"]
    f = io.BytesIO(jsonl_bytes(ROWS))
    f.name = "mcq.jsonl"
    r = c.post(reverse("dashboard:dataset_upload"), {"file": f})
    assert r.status_code == 302
    page = c.get(r["Location"]).content.decode()
    assert "id=\"verifier-fit\"" in page
    assert "fits verifiers: none;" in page
    assert '<tr class="fit-missing" data-verifier="mcqa">' in page and "<td>3, 5, 7</td>" in page
    f = io.BytesIO(jsonl_bytes(ROWS))
    f.name = "mcq.jsonl"
    r = c.post(reverse("dashboard:dataset_upload"), {"file": f, "verifier": "mcqa", "accept_partial": "on"})
    page = c.get(r["Location"]).content.decode()
    # the built-ins these rows serve (plugins other tests registered in this process may be listed beside them)
    fits = re.search(r"fits verifiers: ([^;<]*);", page).group(1).split(", ")
    assert {"exact", "judge", "math", "mcqa", "nemo_gym", "normalized"} <= set(fits) and "code" not in fits, fits
    assert "code needs verifier_metadata.unit_tests (missing in lines 1, 2, 4, 6, 8; 5 rows)" in page
    assert '<tr class="fit-ok" data-verifier="mcqa">' in page and '<tr class="fit-missing" data-verifier="code">' in page


def _peak(path, **kw):
    tracemalloc.start()
    try:
        ds = ingest_jsonl(path, name=path.name, **kw)
        return ds, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_fit_keeps_streaming_memory_bounded(tmp_path, monkeypatch):
    """Every row lacks mcqa's and code's fields: the fit keeps counts and 20 line numbers, not the rows. (Both
    files are past the bound of rows numbered in memory, whose own bounded cost test_datasets measures.)"""
    from controlplane.datasets.services import _RowWriter

    monkeypatch.setattr(_RowWriter, "NUMBER_IN_MEMORY_MAX_ROWS", 5_000)
    def gen(path, n):
        with open(path, "wb") as f:
            for i in range(n):
                f.write(b'{"responses_create_params": {"input": "What is %d?"}, "expected_answer": "%d"}\n' % (i, i))
        return path

    ds_s, peak_s = _peak(gen(tmp_path / "s.jsonl", 10_000), verifier="math")
    ds_b, peak_b = _peak(gen(tmp_path / "b.jsonl", 100_000), verifier="math")
    assert ds_b.row_count == 100_000 and ds_b.validation_report["verifiers"]["mcqa"]["lacking_rows"] == 100_000
    assert ds_b.validation_report["verifiers"]["math"]["fits"]
    assert peak_b < 1.5 * peak_s + 2 * 2**20, (peak_s, peak_b)
