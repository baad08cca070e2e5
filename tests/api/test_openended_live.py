"""Open-ended collection against a LIVE server and a real Celery worker (the stack of test_cli_live): a trainer
consumes with rolloutctl's RolloutStream, over HTTP only. Chunks are dispatched through Celery as the buffer has
room (after a chunk, after each acknowledgement); collection holds at the buffer while the trainer does not
acknowledge, runs past one pass while it does, and a stop ends it with every rollout handed out once."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from controlplane.jobs.models import CollectionJob, JobChunk
from rolloutctl.stream import RolloutStream
from tests.factories import ingest_dataset, make_endpoint

from .test_cli_live import cli, stack  # noqa: F401  (the live web + worker fixture)


def _api(url, token, method, path, body=None):
    req = urllib.request.Request(
        f"{url}/api/{path}",
        method=method,
        data=json.dumps(body).encode() if body else None,
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _settled(url, token, job_id, timeout=60):
    """The job's open_ended figures once nothing is in flight and the stored count held for a second."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        oe = _api(url, token, "GET", f"jobs/{job_id}/")["open_ended"]
        idle = not JobChunk.objects.filter(job_id=job_id).exclude(state="done").exists()
        if idle and last is not None and oe["stored"] == last:
            return oe
        last = oe["stored"] if idle else None
        time.sleep(1.0)
    raise AssertionError("the job never settled")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_open_ended_job_with_a_live_worker_and_a_trainer(stack, simulator_factory, django_user_model):  # noqa: F811
    url, token, procs = stack
    sim = simulator_factory(ttft_ms=5, itl_ms=0, jitter=0, seed=9, math_accuracy=0.5)
    user = django_user_model.objects.get(username="ci")
    dataset = ingest_dataset(user, n=10)
    endpoint = make_endpoint(user, sim.url, model=sim.model, name="sim-live-oe")
    job = _api(
        url,
        token,
        "POST",
        "jobs/",
        {
            "dataset": dataset.pk,
            "endpoint": endpoint.pk,
            "num_repeats": 2,
            "chunk_size": 3,
            "num_samples_in_parallel": 4,
            "responses_create_params": {"max_output_tokens": 8},
            "open_ended": {"buffer": 12, "shuffle": True, "seed": 5, "consumer": "trainer"},
        },
    )
    job_id = job["id"]
    assert job["open_ended"]["bound"] == 12 + 6 - 1  # chunks of 3 rows x 2 repeats

    # nobody acknowledges: it holds at the buffer, within the bound, and is not flagged stalled
    oe = _settled(url, token, job_id)
    assert 12 <= oe["stored"] <= 17 and oe["unconsumed"] == oe["stored"], oe
    assert _api(url, token, "GET", f"jobs/{job_id}/")["state"] == "running"

    # a trainer consumes: collection resumes through the worker, pass after pass, never past the bound
    trainer = RolloutStream(url, token, job_id, "trainer", max=5, wait=5)
    seen, worst = [], 0
    while len(seen) < 45:  # more than two passes of 20
        batch = trainer.take()
        assert batch is not None, "the stream ran dry:\n" + procs[1].tail()
        trainer.ack(batch)
        seen += [r["id"] for r in batch.rollouts]
        oe = _api(url, token, "GET", f"jobs/{job_id}/")["open_ended"]
        worst = max(worst, oe["unconsumed"])
    assert worst <= 17 and oe["pass_index"] >= 2 and oe["consumption_per_s"] > 0, oe
    assert oe["acked"] == len(seen)

    # stop: what is in flight finishes, then it completes; the trainer drains the rest, each rollout once
    stopped = _api(url, token, "POST", f"jobs/{job_id}/stop/")
    assert stopped["open_ended"]["stopping"]
    for batch in trainer.batches(until_finished=True, idle_timeout_s=60):
        seen += [r["id"] for r in batch.rollouts]
    final = _api(url, token, "GET", f"jobs/{job_id}/")
    assert final["state"] == "completed", final
    trainer.take(wait=0)  # nothing left; the loop's last batch is acknowledged by the take after it
    assert len(seen) == len(set(seen)) == final["progress"]["completed"], (len(seen), final["progress"])
    assert final["progress"]["total"] == final["progress"]["done"] == final["open_ended"]["stored"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_rolloutctl_submits_and_stops_an_open_ended_job(stack, simulator_factory, django_user_model):  # noqa: F811
    """`rolloutctl submit --open-ended --buffer N --shuffle --seed S --consumer NAME` and `rolloutctl stop JOB`,
    as subprocesses speaking HTTP to the live server; a trainer consumes between them."""
    url, token, procs = stack
    sim = simulator_factory(ttft_ms=5, itl_ms=0, jitter=0, seed=4, math_accuracy=0.5)
    user = django_user_model.objects.get(username="ci")
    dataset = ingest_dataset(user, n=6)
    endpoint = make_endpoint(user, sim.url, model=sim.model, name="sim-live-oe-cli")
    submit = [
        "submit",
        "--dataset-id",
        dataset.pk,
        "--endpoint",
        endpoint.pk,
        "--num-repeats",
        2,
        "--chunk-size",
        3,
        "--num-samples-in-parallel",
        4,
        "--max-output-tokens",
        8,
    ]

    r = cli(url, token, *submit, "--buffer", 8)  # a usage error, before anything is sent
    assert r.returncode == 2 and "--buffer: only with --open-ended" in r.stderr, r.stderr
    r = cli(url, token, *submit, "--open-ended", "--buffer", 8, "--shuffle", "--seed", 5, "--consumer", "grpo")
    assert r.returncode == 0, f"{r.stderr}\n{procs[0].tail()}"
    job_id = int(r.stdout.strip().splitlines()[-1])
    stored = CollectionJob.objects.get(pk=job_id).open_ended
    assert (stored["buffer"], stored["shuffle"], stored["seed"], stored["consumer"]) == (8, True, 5, "grpo")
    job = _api(url, token, "GET", f"jobs/{job_id}/")
    assert job["open_ended"]["consumer"] == "grpo" and job["open_ended"]["bound"] == 8 + 6 - 1

    trainer = RolloutStream(url, token, job_id, "grpo", max=4, wait=30)  # a loaded machine
    seen = []
    while len(seen) < 16:  # past one pass of 12: it keeps collecting while the trainer acknowledges
        batch = trainer.take()
        assert batch is not None, "the stream ran dry:\n" + procs[1].tail()
        trainer.ack(batch)
        seen += [r["id"] for r in batch.rollouts]

    r = cli(url, token, "stop", job_id)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("running", "completed") and f"job {job_id}: " in r.stderr, (r.stdout, r.stderr)
    assert _api(url, token, "GET", f"jobs/{job_id}/")["open_ended"]["stopping"]
    for batch in trainer.batches(until_finished=True, idle_timeout_s=60):
        seen += [r["id"] for r in batch.rollouts]
    final = _api(url, token, "GET", f"jobs/{job_id}/")
    assert final["state"] == "completed", final
    trainer.take(wait=0)
    assert len(seen) == len(set(seen)) == final["progress"]["completed"], (len(seen), final["progress"])

    r = cli(url, token, "stop", job_id)  # no longer running: the API's answer, shown
    assert r.returncode == 5 and "HTTP 409" in r.stderr, r.stderr
