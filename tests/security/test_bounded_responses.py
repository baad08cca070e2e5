"""Bounded responses: dataset rows, previews and lists never answer hundreds of MB. A row longer than
DATASET_ROW_MAX_CHARS comes as an excerpt (read as such by the database), a page of rows stops before
DATASET_ROWS_MAX_CHARS, descriptions are at most 2,000 characters (model and API), and the dataset and endpoint
lists are paginated."""
from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from rest_framework.test import APIClient

from controlplane.datasets.models import Dataset
from controlplane.endpoints.models import Endpoint
from tests.factories import jsonl_bytes, make_dataset, make_user, task_line

pytestmark = pytest.mark.django_db


@pytest.fixture
def mallory():
    return make_user("mallory")


@pytest.fixture
def api(mallory):
    c = APIClient()
    c.force_authenticate(mallory)
    return c


def _row(i, chars):
    return {"responses_create_params": {"input": [{"role": "user", "content": "x" * chars}]},
            "question": f"q{i}", "expected_answer": "1"}


def test_huge_rows_come_as_excerpts(api, mallory):
    ds = make_dataset(mallory, rows=[_row(i, 1_500_000) for i in range(6)])  # 9 MB of rows
    r = api.get(f"/api/datasets/{ds.pk}/rows/?limit=100")
    assert r.status_code == 200
    assert len(r.content) < 100_000, len(r.content)
    rows = r.json()["rows"]
    assert [x["index"] for x in rows] == list(range(6))
    assert all(x["truncated"] and x["data"] is None and x["size_chars"] > 1_500_000 for x in rows)
    assert all(x["excerpt"].startswith('{"') and len(x["excerpt"]) <= 4000 for x in rows)
    # the dashboard's preview is as small
    web = Client()
    web.force_login(mallory)
    page = web.get(f"/datasets/{ds.pk}/")
    assert page.status_code == 200 and len(page.content) < 200_000, len(page.content)


def test_a_page_of_rows_stops_at_its_budget(api, mallory, settings):
    settings.DATASET_ROWS_MAX_CHARS = 100_000
    ds = make_dataset(mallory, rows=[_row(i, 20_000) for i in range(30)])  # 600 kB in all
    seen, offset = [], 0
    while offset is not None:
        r = api.get(f"/api/datasets/{ds.pk}/rows/?offset={offset}&limit=100")
        assert len(r.content) < 110_000, len(r.content)
        body = r.json()
        assert body["rows"], body
        seen += [x["index"] for x in body["rows"]]
        assert all(x["data"]["question"] == f"q{x['index']}" for x in body["rows"])
        offset = body["next_offset"]
    assert seen == list(range(30))


def test_descriptions_are_bounded(api, mallory):
    body = jsonl_bytes(task_line(i) for i in range(2))
    r = api.post("/api/datasets/?description=" + "d" * 100_000, data=body, content_type="application/x-ndjson")
    assert r.status_code == 400 and "description" in r.json(), r.content[:300]
    r = api.post("/api/datasets/?description=" + "d" * 2000, data=body, content_type="application/x-ndjson")
    assert r.status_code == 201, r.content[:300]
    ds = Dataset.objects.get(pk=r.json()["id"])
    ds.description = "d" * 2001
    with pytest.raises(ValidationError):
        ds.full_clean()


def test_dataset_and_endpoint_lists_are_paginated(api, mallory):
    Dataset.objects.bulk_create(Dataset(owner=mallory, name=f"d{i}", description="d" * 2000, status="ready")
                                for i in range(130))
    Endpoint.objects.bulk_create(Endpoint(owner=mallory, name=f"e{i}", base_url="http://127.0.0.1:9", model_name="m")
                                 for i in range(130))
    for url in ("/api/datasets/", "/api/endpoints/"):
        ids, page = [], api.get(url).json()
        assert isinstance(page, dict) and len(page["results"]) == 100, url
        while True:
            ids += [x["id"] for x in page["results"]]
            if not page["next"]:
                break
            page = api.get(page["next"]).json()
        assert len(ids) == len(set(ids)) == 130, url
        assert ids == sorted(ids, reverse=True)  # newest first
        assert api.get(url + "?page_size=501").status_code == 400
    assert len(json.dumps(api.get("/api/datasets/?page_size=500").json())) < 1_500_000
