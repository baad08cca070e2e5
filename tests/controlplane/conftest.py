"""Shared factories for controlplane tests: `user`, `math_dataset(n)`, `sim_endpoint(url)`.

Datasets are built directly (Dataset + bulk_create of DatasetRow), with math rows shaped like
scripts/make_math_dataset.py's: a NeMo Gym row with `responses_create_params.input`, `question` and
`expected_answer`, which the simulator answers ('... \\boxed{N}') and the math verifier scores.
"""
from __future__ import annotations

import hashlib
import json
import random

import pytest


def math_rows(n: int, seed: int = 0, start: int = 0) -> list[dict]:
    """n arithmetic tasks, deterministic for a seed; row i is unique (so task indices are distinct)."""
    rng = random.Random(seed)
    rows = []
    for i in range(start, start + n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}?"
        rows.append({
            "responses_create_params": {"input": [{"role": "user", "content": question}]},
            "question": question,
            "expected_answer": str(answer),
            "id": f"math-{i}",
        })
    return rows


@pytest.fixture
def user(db, django_user_model):
    return django_user_model.objects.create_user(username="jobs-user", password="pw-jobs-user")


@pytest.fixture
def math_dataset(db):
    """math_dataset(n, owner=None, name=..., rows=None) -> a READY Dataset with n math rows."""
    from controlplane.datasets.models import Dataset, DatasetRow

    def make(n: int = 20, owner=None, name: str | None = None, rows: list[dict] | None = None, seed: int = 0):
        rows = rows if rows is not None else math_rows(n, seed=seed)
        digest = hashlib.sha256()
        size = 0
        for r in rows:
            line = json.dumps(r).encode() + b"\n"
            digest.update(line)
            size += len(line)
        ds = Dataset.objects.create(owner=owner, name=name or f"math-{len(rows)}", status=Dataset.Status.READY,
                                    row_count=len(rows), size_bytes=size, sha256=digest.hexdigest(),
                                    source_filename="math.jsonl")
        DatasetRow.objects.bulk_create(
            (DatasetRow(dataset=ds, index=i, line_number=i + 1, data=r) for i, r in enumerate(rows)),
            batch_size=2000,
        )
        return ds

    return make


@pytest.fixture
def sim_endpoint(db):
    """sim_endpoint(url, **fields) -> an Endpoint for a simulator (or any OpenAI-compatible server)."""
    from controlplane.endpoints.models import Endpoint

    def make(url: str, model: str = "sim-model", owner=None, **fields):
        fields.setdefault("name", f"sim {url}")
        fields.setdefault("request_timeout_s", 30.0)
        fields.setdefault("connect_timeout_s", 5.0)
        return Endpoint.objects.create(owner=owner, base_url=url, model_name=model, **fields)

    return make
