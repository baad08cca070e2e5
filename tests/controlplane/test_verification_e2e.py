"""The must-show: 5,000 rollouts collected WITHOUT verification (deferred), then verified in a batch run by
a REAL Celery worker that is SIGKILLed (its whole process group) mid-run; a new worker and beat (the
watchdog) hand the run out again, it resumes after its cursor, and every reward equals the reward an
inline job got on the same responses (a second simulator with the same seed answers identically)."""
from __future__ import annotations

import os
import random
import signal
import sys
import time
import uuid

import pytest

from controlplane.jobs import runtime, services, verification
from controlplane.jobs.models import JobState, Rollout, VerificationRun
from workers.engine.convert import response_text

from .test_jobs_e2e import LEASE_S, Proc, _database_url
from tests.lanes import serve_control

N = 5000


def unique_rows(n):
    rng = random.Random(5)
    out = []
    for i in range(n):  # every question distinct (the simulator's answer depends on the prompt and its count)
        b = rng.randint(0, 999)
        q = f"What is {i} + {b}?"
        out.append({"responses_create_params": {"input": [{"role": "user", "content": q}]}, "question": q,
                    "expected_answer": str(i + b)})
    return out


def _collect(user, ds, ep, mode):
    job = services.create_job(owner=user, dataset=ds, endpoint=ep, verify_mode=mode, verifier="math",
                              num_samples_in_parallel=64, chunk_size=N, launch=False,
                              responses_create_params={"max_output_tokens": 12})
    runtime.run_job_inline(job)
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and job.completed_count == N, job.error_message
    return job


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
def test_deferred_5000_verified_in_a_batch_that_survives_a_worker_kill(user, math_dataset, sim_endpoint,
                                                                        simulator_factory, tmp_path, monkeypatch):
    ds = math_dataset(rows=unique_rows(N))
    knobs = dict(seed=21, math_accuracy=0.6, ttft_ms=0, itl_ms=0, jitter=0)
    deferred = _collect(user, ds, sim_endpoint(simulator_factory(**knobs).url), "deferred")
    inline = _collect(user, ds, sim_endpoint(simulator_factory(**knobs).url), "inline")
    assert not Rollout.objects.filter(job=deferred, reward__isnull=False).exists()

    queue = f"verify-e2e-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue,
           "JOBS_LEASE_TIMEOUT_S": str(LEASE_S), "JOBS_WATCHDOG_INTERVAL_S": "1", "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "VERIFY_JOB_PROCESSES": "2"}
    celery = [sys.executable, "-m", "celery", "-A", "controlplane"]

    def worker(name):
        return Proc(name, [*celery, "worker", "-P", "threads", "-c", "2", "-Q", serve_control(queue), "-n", f"{name}-{queue}@%h",
                           "--without-gossip", "--without-mingle", "-l", "info"], env, tmp_path)

    from controlplane.celery import app

    monkeypatch.setitem(app.conf.changes, "task_default_queue", queue)  # this process sends "verify this job" there
    procs = []
    try:
        w1 = worker("worker1")
        procs.append(w1)
        run = verification.start_verification(deferred)  # dispatched on commit, like the API's
        deadline = time.monotonic() + 240
        while VerificationRun.objects.get(pk=run.pk).verified < 1000:
            assert time.monotonic() < deadline, "no verification progress:\n" + w1.tail()
            assert w1.popen.poll() is None, "worker exited:\n" + w1.tail()
            time.sleep(0.05)
        w1.killpg(signal.SIGKILL)
        w1.popen.wait(10)
        at_kill = VerificationRun.objects.get(pk=run.pk)
        print(f"\nSIGKILL with {at_kill.verified} of {N} verified")
        assert at_kill.state == "running" and at_kill.verified < N, "the kill landed after the run ended"

        w2 = worker("worker2")
        procs.append(w2)
        beat = Proc("beat", [*celery, "beat", "-l", "info", "-s", str(tmp_path / "beat-schedule")], env, tmp_path)
        procs.append(beat)
        deadline = time.monotonic() + 420
        while VerificationRun.objects.get(pk=run.pk).state in ("pending", "running"):
            assert time.monotonic() < deadline, (f"run did not finish: {VerificationRun.objects.filter(pk=run.pk).values()}"
                                                 "\nworker2:\n" + w2.tail(8000))
            time.sleep(0.5)
    finally:
        for p in reversed(procs):
            p.stop()

    run.refresh_from_db()
    print(f"final: {run.state}, verified {run.verified}, attempts {run.attempts}, info {run.info}")
    assert run.state == "done" and run.verified == N and run.attempts >= 2 and run.errors == 0
    got = {r.task_index: (response_text(r.data["response"]), r.reward, r.data.get("extracted_answer"))
           for r in Rollout.objects.filter(job=deferred)}
    want = {r.task_index: (response_text(r.data["response"]), r.reward, r.data.get("extracted_answer"))
            for r in Rollout.objects.filter(job=inline)}
    assert len(got) == N and got == want  # same responses, same rewards, same verifier fields
    deferred.refresh_from_db()
    inline.refresh_from_db()
    assert deferred.aggregate_metrics["mean/reward"] == pytest.approx(inline.aggregate_metrics["mean/reward"])
    assert 0.4 < deferred.aggregate_metrics["mean/reward"] < 0.8
