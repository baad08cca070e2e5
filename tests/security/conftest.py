"""Fixtures for the hardening tests: two users (one staff), API and browser clients, small objects."""
from __future__ import annotations

import hashlib
import json

import pytest
from django.core.cache import cache
from django.test import Client
from rest_framework.test import APIClient


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def mallory(db, django_user_model):
    return django_user_model.objects.create_user(username="mallory", password="pw-mallory-123")


@pytest.fixture
def api(mallory):
    c = APIClient()
    c.force_authenticate(mallory)
    return c


@pytest.fixture
def web(mallory):
    c = Client()
    c.force_login(mallory)
    return c


def task_rows(n: int) -> list[dict]:
    return [{"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
             "question": f"What is {i} + 1?", "expected_answer": str(i + 1)} for i in range(n)]


def make_dataset(owner, n=3):
    from controlplane.datasets.models import Dataset, DatasetRow

    rows = task_rows(n)
    blob = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    ds = Dataset.objects.create(owner=owner, name="tasks", status=Dataset.Status.READY, row_count=n,
                                size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    DatasetRow.objects.bulk_create(DatasetRow(dataset=ds, index=i, line_number=i + 1, data=r) for i, r in enumerate(rows))
    return ds


def make_endpoint(owner, url="http://127.0.0.1:9", **kw):
    from controlplane.endpoints.models import Endpoint

    kw.setdefault("model_name", "m")
    return Endpoint.objects.create(owner=owner, name="ep", base_url=url, **kw)
