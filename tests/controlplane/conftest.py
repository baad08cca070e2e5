"""Fixtures for controlplane tests (factories in tests/factories.py): `user`, `math_dataset(n)`, `sim_endpoint(url)`."""
from __future__ import annotations

import pytest

from tests.factories import make_dataset, make_endpoint, make_user, math_rows


@pytest.fixture
def user(db):
    return make_user("jobs-user")


@pytest.fixture
def math_dataset(db):
    """math_dataset(n, owner=None, name=..., rows=None) -> a READY Dataset with n math rows."""

    def make(n: int = 20, owner=None, name: str | None = None, rows: list[dict] | None = None, seed: int = 0):
        return make_dataset(owner, name=name, rows=rows if rows is not None else math_rows(n, seed=seed))

    return make


@pytest.fixture
def sim_endpoint(db):
    """sim_endpoint(url, **fields) -> an Endpoint for a simulator (or any OpenAI-compatible server)."""

    def make(url: str, model: str = "sim-model", owner=None, **fields):
        fields.setdefault("name", f"sim {url}")
        fields.setdefault("connect_timeout_s", 5.0)
        return make_endpoint(owner, url, model=model, **fields)

    return make
