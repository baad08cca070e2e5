"""Fixtures for the REST API tests: users with tokens, API clients, and small domain objects."""
from __future__ import annotations

import io
import json

import pytest
from django.core.cache import cache
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient


def task_line(i: int, answer: str | None = None) -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + {i}?"}]},
            "question": f"What is {i} + {i}?", "expected_answer": answer if answer is not None else str(2 * i)}


def jsonl_bytes(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" if not isinstance(r, (bytes, str)) else
                    (r.encode() if isinstance(r, str) else r) + b"\n" for r in rows)


@pytest.fixture(autouse=True)
def _fresh_throttle_cache(settings):
    """Each test starts with empty throttle counters and a rate no test reaches by accident."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                               "DEFAULT_THROTTLE_RATES": {"user": "100000/min", "anon": "100000/min"}}
    cache.clear()
    yield
    cache.clear()


def _user(django_user_model, username, **kw):
    user = django_user_model.objects.create_user(username=username, password="pw-" + username, **kw)
    Token.objects.create(user=user)
    return user


@pytest.fixture
def alice(db, django_user_model):
    return _user(django_user_model, "alice")


@pytest.fixture
def bob(db, django_user_model):
    return _user(django_user_model, "bob")


@pytest.fixture
def staff(db, django_user_model):
    return _user(django_user_model, "root", is_staff=True)


def _client(user=None):
    c = APIClient()
    if user is not None:
        c.credentials(HTTP_AUTHORIZATION=f"Token {user.auth_token.key}")
    return c


@pytest.fixture
def anon():
    return _client()


@pytest.fixture
def api(alice):
    return _client(alice)


@pytest.fixture
def bob_api(bob):
    return _client(bob)


@pytest.fixture
def staff_api(staff):
    return _client(staff)


def make_dataset(owner, n=5, name="math"):
    from controlplane.datasets.services import ingest_jsonl

    return ingest_jsonl(io.BytesIO(jsonl_bytes(task_line(i) for i in range(n))), name=name, owner=owner)


def make_endpoint(owner, **kw):
    from controlplane.endpoints.models import Endpoint

    fields = {"name": "sim", "base_url": "http://127.0.0.1:9", "model_name": "sim-model", "api_key": "sk-secret"}
    fields.update(kw)
    return Endpoint.objects.create(owner=owner, **fields)


def make_job(owner, dataset=None, endpoint=None, state=None, **kw):
    """A job created through the service without launching it (no Celery), optionally forced into a state."""
    from controlplane.jobs.models import CollectionJob
    from controlplane.jobs.services import create_job

    dataset = dataset or make_dataset(owner)
    endpoint = endpoint or make_endpoint(owner)
    job = create_job(owner=owner, dataset=dataset, endpoint=endpoint, launch=False, **kw)
    if state is not None:
        CollectionJob.objects.filter(pk=job.pk).update(state=state)
        job.refresh_from_db()
    return job


def add_rollouts(job, n, *, failed_every=0, start_task=0):
    """Bulk-insert n rollouts (reward alternates 0/1, wall_ms = 10*i); every failed_every-th row failed."""
    from controlplane.jobs.models import Rollout

    rows = []
    for i in range(n):
        failed = bool(failed_every) and i % failed_every == 0
        task = start_task + i
        data = {**task_line(task), "_ng_task_index": task, "_ng_rollout_index": 0}
        if not failed:
            data.update(reward=float(i % 2), response={"id": f"r{task}", "output": [], "status": "completed"})
        rows.append(Rollout(job=job, task_index=task, rollout_index=0,
                            status=Rollout.Status.FAILED if failed else Rollout.Status.OK,
                            failure_class="http_5xx" if failed else "", error="boom" if failed else "",
                            reward=None if failed else float(i % 2), wall_ms=10.0 * i, data=data))
    Rollout.objects.bulk_create(rows, batch_size=2000)
    return rows


@pytest.fixture
def dataset(alice):
    return make_dataset(alice)


@pytest.fixture
def endpoint(alice):
    return make_endpoint(alice)


@pytest.fixture
def job(alice, dataset, endpoint):
    return make_job(alice, dataset, endpoint)
