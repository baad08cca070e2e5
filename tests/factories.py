"""Test factories shared by every test folder: rows, users, datasets, endpoints, jobs and rollouts.

Datasets are built directly (Dataset + bulk_create of DatasetRow) unless a test needs the real ingest
(`ingest_dataset`). Math rows are NeMo Gym rows with `responses_create_params.input`, `question` and
`expected_answer`, which the simulator answers ('... \\boxed{N}') and the math verifier scores.
"""
from __future__ import annotations

import hashlib
import io
import json
import random

from django.contrib.auth import get_user_model
from django.utils import timezone

from controlplane.datasets.models import Dataset, DatasetRow
from controlplane.datasets.services import ingest_jsonl
from controlplane.endpoints.models import Endpoint
from controlplane.jobs.models import CollectionJob, JobMetricSample, Rollout
from controlplane.jobs.services import create_job


# ------------------------------------------------------------------------------------------------ rows
def math_rows(n: int, seed: int = 0, start: int = 0) -> list[dict]:
    """n arithmetic tasks (+, -, *), deterministic for a seed; row i is unique (so task indices are distinct)."""
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


def sum_rows(n: int, seed: int = 0) -> list[dict]:
    """n sums with a system prompt asking for a boxed answer (the chat shape most datasets have)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        q = f"What is {a} + {b}?"
        rows.append({"responses_create_params": {"input": [{"role": "system", "content": "Answer in \\boxed{}."},
                                                           {"role": "user", "content": q}]},
                     "question": q, "expected_answer": str(a + b), "id": f"math-{i}"})
    return rows


def task_line(i: int, answer: str | None = None) -> dict:
    """Task i: 'What is i + i?' (expected 2i unless `answer`)."""
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + {i}?"}]},
            "question": f"What is {i} + {i}?", "expected_answer": answer if answer is not None else str(2 * i)}


def jsonl_bytes(rows) -> bytes:
    """JSONL of dicts (serialized) and of str / bytes lines (as they are)."""
    return b"".join(json.dumps(r).encode() + b"\n" if not isinstance(r, (bytes, str)) else
                    (r.encode() if isinstance(r, str) else r) + b"\n" for r in rows)


# ------------------------------------------------------------------------------------------- objects
def api_token(user) -> str:
    """A new API token for `user` (the plaintext; only its hash is stored)."""
    from controlplane.api.auth import issue_token

    return issue_token(user)[0]


def make_user(username: str, password: str | None = None, *, token: bool = False, **fields):
    """A user (password `pw-<username>` unless given); with token=True also an API token, kept (the database
    has only its hash) as `user.api_token`."""
    user = get_user_model().objects.create_user(username=username, password=password or f"pw-{username}", **fields)
    if token:
        user.api_token = api_token(user)
    return user


def make_dataset(owner=None, n: int = 20, name: str | None = None, *, rows: list[dict] | None = None, seed: int = 0):
    """A READY Dataset of `rows` (default: n `sum_rows`), written directly to the database."""
    rows = rows if rows is not None else sum_rows(n, seed)
    blob = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    ds = Dataset.objects.create(owner=owner, name=name or f"math-{len(rows)}", status=Dataset.Status.READY,
                                row_count=len(rows), size_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                                source_filename="math.jsonl")
    DatasetRow.objects.bulk_create(
        (DatasetRow(dataset=ds, index=i, line_number=i + 1, data=r) for i, r in enumerate(rows)), batch_size=2000)
    return ds


def ingest_dataset(owner, n: int = 5, name: str = "math"):
    """A Dataset of n `task_line` rows loaded through the real ingest."""
    return ingest_jsonl(io.BytesIO(jsonl_bytes(task_line(i) for i in range(n))), name=name, owner=owner)


def make_endpoint(owner=None, url: str = "http://127.0.0.1:9", *, name: str = "sim", model: str = "sim-model", **fields):
    """An Endpoint (fields override the defaults, base_url / model_name included)."""
    fields = {"name": name, "base_url": url, "model_name": model, "request_timeout_s": 30.0, **fields}
    return Endpoint.objects.create(owner=owner, **fields)


def service_job(owner, dataset=None, endpoint=None, state=None, **kw):
    """A job created through the service without launching it (no Celery), optionally forced into a state."""
    dataset = dataset or ingest_dataset(owner)
    endpoint = endpoint or make_endpoint(owner, api_key="sk-secret")
    job = create_job(owner=owner, dataset=dataset, endpoint=endpoint, launch=False, **kw)
    if state is not None:
        CollectionJob.objects.filter(pk=job.pk).update(state=state)
        job.refresh_from_db()
    return job


def make_job(owner, dataset, endpoint, *, n_rollouts=0, state="completed", rewards=None, repeats=1, name="",
             fail_every=0):
    """A job with n_rollouts rows (task i // repeats, repeat i % repeats) and five metric samples, written
    directly. rewards: callable(task, repeat); every fail_every-th row failed (HTTP 429)."""
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
                            wall_ms=100.0 + i % 50, input_tokens=12, output_tokens=9,
                            created_at=now - timezone.timedelta(seconds=3)))  # stored while its samples ran
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


def add_rollouts(job, n, *, failed_every=0, start_task=0):
    """Bulk-insert n rollouts (reward alternates 0/1, wall_ms = 10*i); every failed_every-th row failed."""
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


class InlineRun:
    """`job` run by the CLI's inline runner in a thread of its own (its database connection closed when it ends),
    so that a test can act while it runs: wait_for_rows(n), then join() for the finished job."""

    def __init__(self, job):
        import threading

        from controlplane.jobs.runtime import run_job_inline

        self.box = {}

        def run():
            try:
                self.box["job"] = run_job_inline(job)
            finally:
                from django.db import connection
                connection.close()

        self.job = job
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_for_rows(self, n: int, timeout_s: float) -> int:
        """Until the job has stored `n` rollouts or `timeout_s` passed; returns how many it has."""
        import time

        deadline = time.monotonic() + timeout_s
        while (count := Rollout.objects.filter(job=self.job).count()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return count

    def join(self, timeout_s: float):
        self.thread.join(timeout_s)
        return self.box["job"]
