"""The must-show: 2,000 math tasks x 2 repeats collected through a REAL Celery worker (threads pool)
into PostgreSQL; the worker is SIGKILLed (its whole process group) mid-job, a new worker and beat
(watchdog) pick the dead worker's chunks up again, and the job ends with exactly 4,000 rollouts: none
duplicated, none lost, with rewards.

The worker and beat subprocesses use this test's database (DATABASE_URL with the test DB name) and a
Celery queue of their own (CELERY_TASK_DEFAULT_QUEUE), so other workers on the same Redis never see
these tasks.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count

from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobChunk, JobState, Rollout
from tests.lanes import serve_control

REPO = Path(__file__).resolve().parents[2]
N_TASKS, N_REPEATS = 2000, 2
LEASE_S = 5


def _database_url():
    s = connection.settings_dict
    auth = s["USER"] or ""
    if s.get("PASSWORD"):
        auth += ":" + s["PASSWORD"]
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    return f"postgres://{auth}@{host}:{port}/{s['NAME']}"


class Proc:
    def __init__(self, name, args, env, log_dir):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # its own process group: killpg takes all of it

    def killpg(self, sig):
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self):
        if self.popen.poll() is None:
            self.killpg(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.killpg(signal.SIGKILL)
                self.popen.wait(5)
        self.log.close()

    def tail(self, n=4000):
        return self.log_path.read_bytes()[-n:].decode(errors="replace")


@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.django_db(transaction=True)
def test_sigkill_worker_mid_job_is_exactly_once(user, math_dataset, sim_endpoint, simulator_factory, tmp_path):
    sim = simulator_factory(seed=11, ttft_ms=60, itl_ms=2, output_len_min=16, output_len_max=32)
    job = services.create_job(owner=user, dataset=math_dataset(N_TASKS), endpoint=sim_endpoint(sim.url),
                              num_repeats=N_REPEATS, chunk_size=500, num_samples_in_parallel=16, launch=False)
    assert job.chunks.count() == 4 and job.total_rollouts == 4000

    queue = f"jobs-e2e-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue,
           "JOBS_LEASE_TIMEOUT_S": str(LEASE_S), "JOBS_WATCHDOG_INTERVAL_S": "1", "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    celery = [sys.executable, "-m", "celery", "-A", "controlplane"]

    def worker(name):
        return Proc(name, [*celery, "worker", "-P", "threads", "-c", "4", "-Q", serve_control(queue), "-n", f"{name}-{queue}@%h",
                           "--without-gossip", "--without-mingle", "-l", "info"], env, tmp_path)

    procs = []
    try:
        w1 = worker("worker1")
        procs.append(w1)
        # dispatch the job's chunks onto the isolated queue (what create_job(launch=True) does on the default one)
        from celery import Celery

        sender = Celery("e2e-sender", broker=_redis_url(), set_as_current=False)  # never the app tasks use
        with sender.connection_for_write() as conn:
            for chunk_id in job.chunks.values_list("pk", flat=True):
                sender.send_task("controlplane.jobs.tasks.run_chunk_task", args=[chunk_id], queue=queue,
                                 connection=conn)
        JobChunk.objects.filter(job=job).update(dispatched_at=job.created_at)

        # let a few hundred rows in, then SIGKILL the worker and everything it started
        deadline = time.monotonic() + 120
        while Rollout.objects.filter(job=job).count() < 300:
            assert time.monotonic() < deadline, "worker made no progress:\n" + w1.tail()
            assert w1.popen.poll() is None, "worker exited:\n" + w1.tail()
            time.sleep(0.1)
        w1.killpg(signal.SIGKILL)
        w1.popen.wait(10)
        at_kill = Rollout.objects.filter(job=job).count()
        running_at_kill = JobChunk.objects.filter(job=job, state="running").count()
        print(f"\nSIGKILL with {at_kill} rollouts stored, {running_at_kill} chunks running")
        assert at_kill < 4000, "the kill landed after the job finished: slow the simulator down"
        assert CollectionJob.objects.get(pk=job.pk).state == JobState.RUNNING

        # a new worker, and beat: the watchdog reclaims the dead worker's chunks after the lease timeout
        w2 = worker("worker2")
        procs.append(w2)
        beat = Proc("beat", [*celery, "beat", "-l", "info", "-s", str(tmp_path / "beat-schedule")], env, tmp_path)
        procs.append(beat)

        deadline = time.monotonic() + 300
        while True:
            job.refresh_from_db()
            if job.state not in (JobState.QUEUED, JobState.RUNNING):
                break
            assert time.monotonic() < deadline, ("job did not finish; worker2:\n" + w2.tail() + "\nbeat:\n" + beat.tail())
            time.sleep(0.5)
    finally:
        for p in reversed(procs):
            p.stop()

    assert job.state == JobState.COMPLETED, job.error_message
    rows = Rollout.objects.filter(job=job)
    total = rows.count()
    distinct = rows.values("task_index", "rollout_index").distinct().count()
    dupes = rows.values("task_index", "rollout_index").annotate(n=Count("id")).filter(n__gt=1).count()
    pairs = set(rows.values_list("task_index", "rollout_index"))
    print(f"final: {total} rollouts, {distinct} distinct pairs, {dupes} duplicated, "
          f"completed={job.completed_count} failed={job.failed_count}, mean reward {job.aggregate_metrics.get('mean/reward')}, "
          f"chunk attempts {list(job.chunks.order_by('index').values_list('attempts', flat=True))}")
    assert total == 4000 and distinct == 4000 and dupes == 0
    assert pairs == {(t, r) for t in range(N_TASKS) for r in range(N_REPEATS)}  # none lost
    assert job.completed_count + job.failed_count == 4000 and job.completed_count == rows.filter(status="ok").count()
    assert not rows.filter(status="ok", reward__isnull=True).exists()
    assert 0.4 < job.aggregate_metrics["mean/reward"] < 0.95
    assert job.chunks.filter(attempts__gte=2).exists()  # some chunk really was run again
    workers = set(rows.values_list("worker", flat=True).distinct())
    assert len(workers) >= 2  # rows from the killed worker and from the new one


def _redis_url():
    from django.conf import settings

    return settings.CELERY_BROKER_URL
