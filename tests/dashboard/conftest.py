"""Fixtures for the dashboard tests (factories in tests/factories.py): users, and a job with rollouts
built directly in the database (the pages are tested without a model server; the browser test runs
the real runtime against the simulator)."""
from __future__ import annotations

import pytest

from tests.factories import make_dataset, make_endpoint, make_job, make_user


@pytest.fixture
def alice(db):
    return make_user("alice", "alice-pw-123")


@pytest.fixture
def bob(db):
    return make_user("bob", "bob-pw-1234")


@pytest.fixture
def staff(db):
    return make_user("ops", "ops-pw-1234", is_staff=True)


@pytest.fixture
def alice_job(alice):
    ds = make_dataset(alice, n=60)
    ep = make_endpoint(alice)
    return make_job(alice, ds, ep, n_rollouts=120, repeats=2, fail_every=10, name="alice-run")


@pytest.fixture
def no_celery(monkeypatch):
    """Record Celery dispatches instead of sending them to the shared broker."""
    sent = []
    from controlplane.jobs import tasks

    monkeypatch.setattr(tasks.run_chunk_task, "delay", lambda *a, **k: sent.append(("run_chunk", a)))
    monkeypatch.setattr(tasks.finalize_job_task, "delay", lambda *a, **k: sent.append(("finalize", a)))
    return sent


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    """Run this folder against its own test database, so it can run while other suites (sharing the
    PostgreSQL server) create and drop theirs."""
    from django.conf import settings

    for db in settings.DATABASES.values():
        base = db.get("TEST", {}).get("NAME") or f"test_{db['NAME']}"
        if db["ENGINE"].endswith("sqlite3"):
            continue
        db.setdefault("TEST", {})["NAME"] = base + "_dashboard"
