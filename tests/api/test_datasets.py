"""Datasets over the API: upload (multipart and raw JSONL), the bad-line report, list/detail/rows/delete,
and ownership (another user's dataset is a 404)."""
from __future__ import annotations

import io

import pytest

from controlplane.datasets.models import Dataset

from tests.factories import ingest_dataset, jsonl_bytes, service_job, task_line

pytestmark = pytest.mark.django_db


def _upload(api, body: bytes, name="up.jsonl", **fields):
    f = io.BytesIO(body)
    f.name = name
    return api.post("/api/datasets/", {"file": f, **fields}, format="multipart")


def test_multipart_upload_creates_ready_dataset(api, alice):
    r = _upload(api, jsonl_bytes(task_line(i) for i in range(7)), name="seven.jsonl")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "ready" and body["row_count"] == 7
    assert body["name"] == "seven.jsonl" and body["source_filename"] == "seven.jsonl"
    assert len(body["sha256"]) == 64 and body["size_bytes"] > 0
    assert Dataset.objects.get(pk=body["id"]).owner == alice


def test_raw_ndjson_body_upload_with_query_params(api):
    r = api.post("/api/datasets/?name=raw&description=d", data=jsonl_bytes(task_line(i) for i in range(3)),
                 content_type="application/x-ndjson")
    assert r.status_code == 201, r.content
    assert r.json()["name"] == "raw" and r.json()["row_count"] == 3 and r.json()["description"] == "d"


def test_bad_lines_rejected_with_report(api):
    body = jsonl_bytes([task_line(0), "not json", {"no_rcp": 1}, task_line(3),
                        {"responses_create_params": {"input": ""}}])
    r = _upload(api, body)
    assert r.status_code == 400
    report = r.json()
    assert report["bad_line_count"] == 3
    assert [b["line"] for b in report["bad_lines"]] == [2, 3, 5]
    assert all(b["reason"] for b in report["bad_lines"])
    assert "responses_create_params" in report["bad_lines"][1]["reason"]
    assert not Dataset.objects.filter(status="ready").exists()


def test_raw_body_rejected_with_report(api):
    r = api.post("/api/datasets/", data=b"{oops\n" + jsonl_bytes([task_line(1)]), content_type="application/x-ndjson")
    assert r.status_code == 400
    assert r.json()["bad_line_count"] == 1 and r.json()["bad_lines"][0]["line"] == 1


def test_accept_partial_keeps_good_lines(api):
    body = jsonl_bytes([task_line(0), "nope", task_line(2)])
    r = _upload(api, body, accept_partial="true")
    assert r.status_code == 201, r.content
    assert r.json()["row_count"] == 2
    detail = api.get(f"/api/datasets/{r.json()['id']}/").json()
    assert detail["validation_report"]["bad_line_count"] == 1
    r = api.post("/api/datasets/?accept_partial=true", data=body, content_type="application/x-ndjson")
    assert r.status_code == 201 and r.json()["row_count"] == 2


def test_upload_without_file_is_400(api):
    r = api.post("/api/datasets/", {"name": "x"}, format="multipart")
    assert r.status_code == 400 and "file" in r.json()


def test_empty_raw_body_is_400(api):
    r = api.post("/api/datasets/", data=b"", content_type="application/x-ndjson")
    assert r.status_code == 400


def test_unsupported_content_type_is_415(api):
    r = api.post("/api/datasets/", data=b"{}", content_type="application/json")
    assert r.status_code == 415


def test_list_detail_rows_only_own(api, bob_api, alice, bob):
    mine = ingest_dataset(alice, n=30, name="mine")
    theirs = ingest_dataset(bob, n=2, name="theirs")
    ids = [d["id"] for d in api.get("/api/datasets/").json()["results"]]
    assert mine.pk in ids and theirs.pk not in ids
    assert api.get(f"/api/datasets/{mine.pk}/").status_code == 200
    assert api.get(f"/api/datasets/{theirs.pk}/").status_code == 404
    assert api.get(f"/api/datasets/{theirs.pk}/rows/").status_code == 404
    assert api.delete(f"/api/datasets/{theirs.pk}/").status_code == 404
    r = api.get(f"/api/datasets/{mine.pk}/rows/?offset=25&limit=10")
    assert r.status_code == 200
    body = r.json()
    assert body["row_count"] == 30 and [row["index"] for row in body["rows"]] == [25, 26, 27, 28, 29]
    assert body["rows"][0]["data"]["expected_answer"] == "50"
    assert api.get(f"/api/datasets/{mine.pk}/rows/?limit=1000").status_code == 400
    assert api.get(f"/api/datasets/{mine.pk}/rows/?offset=-1").status_code == 400


def test_staff_sees_every_dataset(staff_api, alice, bob):
    a, b = ingest_dataset(alice), ingest_dataset(bob)
    ids = {d["id"] for d in staff_api.get("/api/datasets/").json()["results"]}
    assert {a.pk, b.pk} <= ids


def test_delete_and_conflict_when_used(api, alice):
    free = ingest_dataset(alice)
    assert api.delete(f"/api/datasets/{free.pk}/").status_code == 204
    assert not Dataset.objects.filter(pk=free.pk).exists()
    job = service_job(alice)
    r = api.delete(f"/api/datasets/{job.dataset_id}/")
    assert r.status_code == 409 and "job" in r.json()["detail"]
    assert Dataset.objects.filter(pk=job.dataset_id).exists()


def test_list_filters_by_sha256_status_name(api, alice):
    import hashlib

    body = jsonl_bytes(task_line(i) for i in range(4))
    d = ingest_dataset(alice, n=4, name="four")
    sha = hashlib.sha256(body).hexdigest()
    assert d.sha256 == sha
    ingest_dataset(alice, n=2, name="two")
    assert [x["id"] for x in api.get(f"/api/datasets/?sha256={sha}&status=ready").json()["results"]] == [d.pk]
    assert [x["id"] for x in api.get("/api/datasets/?name=four").json()["results"]] == [d.pk]
    assert api.get("/api/datasets/?sha256=xyz").status_code == 400
