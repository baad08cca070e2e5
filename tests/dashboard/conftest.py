"""Fixtures for the dashboard tests: users, a math dataset, an endpoint, and a job with rollouts
built directly in the database (the pages are tested without a model server; the browser test runs
the real runtime against the simulator)."""
from __future__ import annotations

import hashlib
import json
import random

import pytest

from controlplane.jobs.events import job_group  # noqa: F401  (re-exported for tests)


def math_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        q = f"What is {a} + {b}?"
        rows.append({"responses_create_params": {"input": [{"role": "system", "content": "Answer in \\boxed{}."},
                                                           {"role": "user", "content": q}]},
                     "question": q, "expected_answer": str(a + b), "id": f"math-{i}"})
    return rows


def make_dataset(owner, n=20, name=None, seed=0):
    from controlplane.datasets.models import Dataset, DatasetRow

    rows = math_rows(n, seed)
    blob = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    ds = Dataset.objects.create(owner=owner, name=name or f"math-{n}", status=Dataset.Status.READY, row_count=n,
                                size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                                source_filename="math.jsonl")
    DatasetRow.objects.bulk_create(DatasetRow(dataset=ds, index=i, line_number=i + 1, data=r) for i, r in enumerate(rows))
    return ds


def make_endpoint(owner, url="http://127.0.0.1:9", name="sim"):
    from controlplane.endpoints.models import Endpoint

    return Endpoint.objects.create(owner=owner, name=name, base_url=url, model_name="sim-model", max_retries=1,
                                   request_timeout_s=30)


def make_job(owner, dataset, endpoint, *, n_rollouts=0, state="completed", rewards=None, repeats=1, name="",
             fail_every=0):
    """A job with n_rollouts rows (task i // repeats, repeat i % repeats). rewards: callable(task, repeat)."""
    from django.utils import timezone

    from controlplane.jobs.models import CollectionJob, JobMetricSample, Rollout

    now = timezone.now()
    job = CollectionJob.objects.create(owner=owner, dataset=dataset, endpoint=endpoint, name=name, state=state,
                                       num_repeats=repeats, total_rollouts=max(n_rollouts, 1),
                                       started_at=now - timezone.timedelta(seconds=60),
                                       finished_at=None if state in ("running", "queued", "paused") else now)
    rows = []
    ok = failed = 0
    for i in range(n_rollouts):
        task, rep = divmod(i, repeats)
        is_failed = bool(fail_every) and i % fail_every == fail_every - 1
        reward = None if is_failed else (rewards(task, rep) if rewards else float(i % 2))
        q = f"What is {task} + 1?"
        data = {"responses_create_params": {"input": [{"role": "user", "content": q}]}, "question": q,
                "expected_answer": str(task + 1), "_ng_task_index": task, "_ng_rollout_index": rep}
        if not is_failed:
            data.update({"response": {"id": f"resp-{i}", "status": "completed",
                                      "output": [{"type": "message", "role": "assistant",
                                                  "content": [{"type": "output_text", "text": f"The answer is \\boxed{{{task + 1}}}"}]}],
                                      "usage": {"input_tokens": 12, "output_tokens": 9, "total_tokens": 21}},
                         "reward": reward, "extracted_answer": str(task + 1)})
        rows.append(Rollout(job=job, task_index=task, rollout_index=rep,
                            status="failed" if is_failed else "ok", failure_class="http_429" if is_failed else "",
                            error="429 Too Many Requests" if is_failed else "", reward=reward, data=data,
                            queue_ms=1.0, ttft_ms=20.0 + i % 7, generation_ms=80.0 + i % 11, verify_ms=2.0,
                            wall_ms=100.0 + i % 50, input_tokens=12, output_tokens=9))
        failed += is_failed
        ok += not is_failed
    Rollout.objects.bulk_create(rows, batch_size=1000)
    job.completed_count, job.failed_count = ok, failed
    job.save(update_fields=["completed_count", "failed_count"])
    for k in range(5):
        JobMetricSample.objects.create(job=job, worker="w1", t=now - timezone.timedelta(seconds=5 - k), elapsed_s=55 + k,
                                       completed=ok, samples_per_s=10.0 + k, output_tokens_per_s=90.0 + k,
                                       in_flight=4, parallelism=4, errors={"http_429": k % 2})
    return job


@pytest.fixture
def alice(db, django_user_model):
    return django_user_model.objects.create_user(username="alice", password="alice-pw-123")


@pytest.fixture
def bob(db, django_user_model):
    return django_user_model.objects.create_user(username="bob", password="bob-pw-1234")


@pytest.fixture
def staff(db, django_user_model):
    return django_user_model.objects.create_user(username="ops", password="ops-pw-1234", is_staff=True)


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
