"""The verification cache is job-wide: identical (verifier, version, options, response, expected) work is
computed once across a job's chunks and the workers running them at the same time, and a later
verification run of the same job finds every result. The verifier counts its real computations in Redis
(from the engine's process pool), so the test counts work done, not cache bookkeeping."""
from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest
import redis
from django.db import connection

from controlplane.jobs import runtime, services, verification
from controlplane.jobs.models import JobState, Rollout
from workers.engine.convert import response_text
from workers.verifiers.base import VerifyResult
from workers.verifiers.execution import VerifyExecutor
from tests.lanes import serve_control

REDIS_URL = os.environ.get("TEST_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def _rows(distinct=12, copies=4):
    """Each question `copies` times, spread so that every copy falls in another chunk of 6 rows."""
    out = []
    for _c in range(copies):
        for i in range(distinct):
            q = f"What is {i} + 1?"
            out.append({"responses_create_params": {"input": [{"role": "user", "content": q}]}, "question": q,
                        "expected_answer": str(i + 1)})
    return out


def _worker(job, errors):
    try:
        runtime.run_job_inline(job, wait_for_lease_s=0)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    finally:
        connection.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_identical_work_is_computed_once_across_chunks_workers_and_runs(user, math_dataset, sim_endpoint,
                                                                       simulator_factory, counter, settings):
    settings.VERIFIER_PATH_MODULES = ["tests.verifier_plugins"]  # the operator lets users name its verifiers
    key, computed = counter
    ds = math_dataset(rows=_rows())
    sim = simulator_factory(seed=11, math_accuracy=0.9)
    options = {"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.02}
    job = services.create_job(owner=user, dataset=ds, endpoint=sim_endpoint(sim.url), launch=False,
                              verifier="tests.verifier_plugins:counted", verifier_options=options, num_repeats=2,
                              chunk_size=6, num_samples_in_parallel=8, responses_create_params={"max_output_tokens": 4})
    assert job.chunks.count() == 8
    errors = []
    workers = [threading.Thread(target=_worker, args=(job, errors)) for _ in range(2)]  # two workers, one job
    for t in workers:
        t.start()
    for t in workers:
        t.join(300)
    assert not errors
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and job.completed_count == 96, job.error_message
    rollouts = list(Rollout.objects.filter(job=job))
    distinct = {(response_text(r.data["response"]), r.data["expected_answer"]) for r in rollouts}
    assert 1 < len(distinct) < 96 / 2  # repeats across chunks exist
    assert computed() == len(distinct)  # each identical (answer, expected) computed once, job-wide
    rewards = {}
    for r in rollouts:
        rewards.setdefault((response_text(r.data["response"]), r.data["expected_answer"]), set()).add(r.reward)
    assert all(len(v) == 1 for v in rewards.values())
    stats = verification.collection_cache(job)
    assert stats["lookups"] == 96 and stats["hits"] == 96 - len(distinct)

    # a re-verification of the same job with the same verifier and version: nothing computed again
    run = verification.start_verification(job, launch=False)
    assert verification.run_verification(run.pk, "again", batch_size=40) == "done"
    run.refresh_from_db()
    assert computed() == len(distinct)
    assert run.cache_lookups == 96 and run.cache_hits == 96
    assert {r.pk: r.reward for r in Rollout.objects.filter(job=job)} == {r.pk: r.reward for r in rollouts}


def test_two_executors_in_flight_compute_identical_work_once(counter):
    """Two runs (as two workers would) verify the same 30 items at the same moment: one computation each."""
    key, computed = counter
    scope = f"test:{uuid.uuid4().hex}"
    options = {"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.05}
    row = {"expected_answer": "4"}
    texts = [f"The answer is \\boxed{{{i % 3 + 3}}}" for i in range(30)]  # 3 distinct answers

    async def main():
        a, b = (VerifyExecutor("tests.verifier_plugins:counted_io", options, cache="job", shared_url=REDIS_URL,
                               shared_scope=scope) for _ in range(2))
        try:
            results = await asyncio.gather(*(ex.verify(row, t) for t in texts for ex in (a, b)))
        finally:
            await a.aclose()
            await b.aclose()
        return a, b, results

    a, b, results = asyncio.run(main())
    assert computed() == 3
    assert [r.reward for r in results] == [1.0 if t.endswith("{4}") else 0.0 for t in texts for _ in range(2)]
    assert a.lookups + b.lookups == 60 and a.hits + b.hits == 57
    assert a.stats()["verify_cache_shared"] is True


@pytest.mark.slow
def test_more_lookups_at_once_than_redis_connections_keep_the_shared_cache_on(counter):
    """A run at parallelism 512 looks up 512 results at once: they share a few Redis connections and round
    trips instead of failing with "Too many connections" past redis-py's default pool of 100, which turned
    the job's shared cache off for the rest of the run."""
    from workers.verifiers.shared_cache import MAX_CONNECTIONS

    key, computed = counter
    scope = f"test:{uuid.uuid4().hex}"
    options = {"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.0}
    row = {"expected_answer": "4"}
    texts = [f"The answer is \\boxed{{{i}}}" for i in range(512)]

    async def run_once():
        ex = VerifyExecutor("tests.verifier_plugins:counted_io", options, cache="job", shared_url=REDIS_URL,
                            shared_scope=scope, concurrency=64, shared_choice="always")  # the subject: Redis itself
        pool, opened = ex.shared.redis.connection_pool, []
        make_connection = pool.make_connection
        pool.make_connection = lambda: opened.append(1) or make_connection()  # counts the sockets opened
        try:
            results = await asyncio.gather(*(ex.verify(row, t) for t in texts))
        finally:
            await ex.aclose()  # after the stores still going on in the background
        stats = ex.stats()
        stats["round_trips"] = ex.shared.round_trips
        return results, stats, len(opened)

    results, stats, sockets = asyncio.run(run_once())
    assert stats["verify_cache_shared"] is True and "verify_cache_error" not in stats
    assert stats["verify_cache_computed"] == 512 and computed() == 512
    assert sockets <= MAX_CONNECTIONS
    # 512 lookups and 512 stores: those made in the same loop turn share a round trip (about 100 here)
    assert stats["round_trips"] <= 256
    assert [r.reward for r in results] == [1.0 if i == 4 else 0.0 for i in range(512)]
    # a second run (another chunk, another worker) finds every result in Redis
    _, stats, _ = asyncio.run(run_once())
    assert stats["verify_cache_shared_hits"] == 512 and computed() == 512


def test_redis_down_falls_back_to_the_local_cache(counter):
    key, computed = counter
    options = {"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.0}

    async def main():
        ex = VerifyExecutor("tests.verifier_plugins:counted_io", options, cache="job",
                            shared_url="redis://127.0.0.1:9/0", shared_scope="test:down")
        try:
            out = [await ex.verify({"expected_answer": "4"}, "\\boxed{4}") for _ in range(5)]
        finally:
            await ex.aclose()
        return ex, out

    ex, out = asyncio.run(main())
    assert all(isinstance(r, VerifyResult) and r.reward == 1.0 for r in out)
    assert computed() == 1 and ex.hits == 4
    assert ex.stats()["verify_cache_shared"] is False and "Error" in ex.stats()["verify_cache_error"]


def test_changed_verifier_code_gets_other_keys():
    from workers.verifiers import get_verifier

    v = get_verifier("tests.verifier_plugins:counted")
    fp = v.fingerprint()
    assert fp and fp == get_verifier("tests.verifier_plugins:counted").fingerprint()
    ex = VerifyExecutor("tests.verifier_plugins:counted", {}, cache="job")
    k1 = ex.key({"expected_answer": "1"}, "x")
    v.__dict__["_fingerprint"] = "edited"
    try:
        assert VerifyExecutor("tests.verifier_plugins:counted", {}, cache="job").key({"expected_answer": "1"}, "x") != k1
    finally:
        v.__dict__["_fingerprint"] = fp


@pytest.mark.slow
def test_a_dead_workers_claim_expires_and_the_work_is_taken_over(counter):
    """A worker claimed a verification and died: the others wait no longer than the claim's life."""
    import time

    key, computed = counter
    scope = f"test:{uuid.uuid4().hex}"
    options = {"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.0}
    row, text = {"expected_answer": "4"}, "\\boxed{4}"

    async def main():
        ex = VerifyExecutor("tests.verifier_plugins:counted_io", options, cache="job", shared_url=REDIS_URL,
                            shared_scope=scope, shared_claim_s=1.0)
        r = redis.Redis.from_url(REDIS_URL)
        r.set(f"rcp:vcache:{scope}:{ex.key(row, text)}:claim", b"1", px=1000)  # the dead worker's claim
        r.close()
        t0 = time.monotonic()
        try:
            return await ex.verify(row, text), time.monotonic() - t0
        finally:
            await ex.aclose()

    result, waited = asyncio.run(main())
    assert result.reward == 1.0 and computed() == 1 and 0.5 < waited < 5


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.django_db(transaction=True)
def test_two_real_celery_workers_compute_identical_work_once(user, math_dataset, sim_endpoint, simulator_factory,
                                                              counter, tmp_path, monkeypatch, settings):
    """The same, with the job's chunks taken by two real Celery worker processes."""
    settings.VERIFIER_PATH_MODULES = ["tests.verifier_plugins"]  # the operator lets users name its verifiers
    import sys
    import time

    from controlplane.celery import app
    from controlplane.jobs.models import JobChunk

    from .test_jobs_e2e import Proc, _database_url

    key, computed = counter
    sim = simulator_factory(seed=11, math_accuracy=0.9, ttft_ms=20, itl_ms=0, jitter=0)
    job = services.create_job(owner=user, dataset=math_dataset(rows=_rows()), endpoint=sim_endpoint(sim.url),
                              launch=False, verifier="tests.verifier_plugins:counted", num_repeats=2, chunk_size=6,
                              verifier_options={"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.02},
                              num_samples_in_parallel=8, responses_create_params={"max_output_tokens": 4})
    queue = f"vcache-e2e-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue, "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "VERIFY_POOL_PROCESSES": "1"}
    celery = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "2", "-Q", serve_control(queue),
              "--without-gossip", "--without-mingle", "-l", "info"]
    procs = [Proc(f"w{i}", [*celery, "-n", f"w{i}-{queue}@%h"], env, tmp_path) for i in (1, 2)]
    monkeypatch.setitem(app.conf.changes, "task_default_queue", queue)
    try:
        time.sleep(3)  # both workers listening before the chunks go out, so both take some
        services.dispatch_chunks(job)
        deadline = time.monotonic() + 300
        while True:
            job.refresh_from_db()
            if job.state == JobState.COMPLETED:
                break
            assert job.state in JobState.UNFINISHED, job.error_message
            assert time.monotonic() < deadline, "\n".join(p.tail() for p in procs)
            time.sleep(0.5)
    finally:
        for p in procs:
            p.stop()
    owners = {o.split("#")[0].split(":")[1] for o in JobChunk.objects.filter(job=job).values_list("lease_owner", flat=True)}
    assert len(owners) == 2, owners  # two worker processes (pids) took the chunks
    rollouts = list(Rollout.objects.filter(job=job))
    distinct = {(response_text(r.data["response"]), r.data["expected_answer"]) for r in rollouts}
    assert len(rollouts) == 96 and len(distinct) < 48
    assert computed() == len(distinct)
