"""Endpoint replicas through a REAL Celery worker (threads pool) into PostgreSQL, with real simulator processes:

* one dead replica of two (nothing listens there): the job completes with exactly one row per (task, repeat),
  none failed, every answered attempt on the live replica, the dead one out of rotation on the endpoint page
  and in the API (was: 70 % of attempts to the dead one and 31 of 120 rollouts failed);
* a replica that dies mid-job and comes back (SIGKILL, then a new simulator on the same port): taken out,
  put back, and it serves requests again before the job ends; nothing lost or duplicated.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid

import pytest
from django.db.models import Count
from rest_framework.test import APIClient

from controlplane.jobs import services
from controlplane.jobs.models import JobChunk, JobMetricSample, JobState, Rollout
from tests.controlplane.test_jobs_e2e import Proc, _database_url, _redis_url
from tests.fixtures_simulator import start_simulator
from tests.lanes import serve_control

N_REPEATS = 4


def _dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


def _served(sim) -> int:
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in sim.metrics_text().splitlines()
                   if line.startswith("vllm:request_success_total")))


def _run_job(job, tmp_path, during=None, timeout=90):
    """Dispatch the job's chunks to a worker on a queue of its own; `during(job)` is called every 0.1 s."""
    queue = f"replicas-e2e-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue, "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "REPLICA_PROBE_MAX_S": "0.5",
           "REPLICA_HEALTH_INTERVAL_S": "0.5"}
    worker = Proc("worker", [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "4",
                             "-Q", serve_control(queue), "-n", f"w-{queue}@%h", "--without-gossip", "--without-mingle", "-l", "info"],
                  env, tmp_path)
    try:
        from celery import Celery

        sender = Celery("replicas-e2e-sender", broker=_redis_url(), set_as_current=False)
        with sender.connection_for_write() as conn:
            for chunk_id in job.chunks.values_list("pk", flat=True):
                sender.send_task("controlplane.jobs.tasks.run_chunk_task", args=[chunk_id], queue=queue, connection=conn)
        JobChunk.objects.filter(job=job).update(dispatched_at=job.created_at)
        deadline = time.monotonic() + timeout
        while True:
            job.refresh_from_db()
            if job.state not in (JobState.QUEUED, JobState.RUNNING):
                break
            assert time.monotonic() < deadline, "job did not finish:\n" + worker.tail()
            assert worker.popen.poll() is None, "worker exited:\n" + worker.tail()
            if during is not None:
                during(job)
            time.sleep(0.1)
    finally:
        worker.stop()
    return job


def _assert_exactly_once(job, n_tasks):
    rows = Rollout.objects.filter(job=job)
    assert rows.count() == n_tasks * N_REPEATS
    assert not rows.values("task_index", "rollout_index").annotate(n=Count("id")).filter(n__gt=1).exists()
    assert set(rows.values_list("task_index", "rollout_index")) == {(t, r) for t in range(n_tasks) for r in range(N_REPEATS)}
    assert rows.filter(status="ok").count() == n_tasks * N_REPEATS and job.failed_count == 0


def _final_replica_tables(job):
    """The last tick of every run (chunk) of the job: its per-replica table."""
    latest = {}
    for worker, reps in (JobMetricSample.objects.filter(job=job, extra__has_key="replicas").order_by("t")
                         .values_list("worker", "extra__replicas")):
        latest[worker] = reps
    return list(latest.values())


def _api(user):
    client = APIClient()
    client.force_login(user)  # session auth (the API takes it as well as tokens)
    return client


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_one_dead_replica_of_two_no_rollout_fails(user, math_dataset, sim_endpoint, simulator_factory, tmp_path,
                                                  settings, client):
    settings.REPLICA_LOAD_WINDOW_S = 600  # the page reads the job's ticks after it ended
    live = simulator_factory(seed=21, ttft_ms=30, itl_ms=1, output_len_min=8, output_len_max=16)
    dead = _dead_url()
    n_tasks = 50
    ep = sim_endpoint(dead, owner=user, replica_urls=[live.url], max_retries=3)
    job = services.create_job(owner=user, dataset=math_dataset(n_tasks), endpoint=ep, num_repeats=N_REPEATS,
                              chunk_size=25, num_samples_in_parallel=16, launch=False)
    job = _run_job(job, tmp_path)

    assert job.state == JobState.COMPLETED, job.error_message
    _assert_exactly_once(job, n_tasks)
    assert _served(live) == n_tasks * N_REPEATS  # every rollout answered by the live replica, once

    tables = _final_replica_tables(job)
    assert len(tables) == 2  # one per chunk
    dead_attempts = sum(r["requests"] for t in tables for r in t if r["url"] == dead)
    live_ok = sum(r["ok"] for t in tables for r in t if r["url"] == live.url)
    all_attempts = sum(r["requests"] for t in tables for r in t)
    assert live_ok == n_tasks * N_REPEATS and sum(r["ok"] for t in tables for r in t if r["url"] == dead) == 0
    # a run probes its replicas as it starts and takes a refusing one out at its first refusal: the dead
    # replica sees at most the requests already on their way, never a share of the job
    assert dead_attempts <= 2 * 8 and dead_attempts / all_attempts <= 0.10, (dead_attempts, all_attempts)
    print(f"\ndead replica: {dead_attempts} of {all_attempts} attempts ({dead_attempts / all_attempts:.1%}); "
          f"0 of {n_tasks * N_REPEATS} rollouts failed")

    # the endpoint API and page: the dead replica out of rotation with its reason, the live one carrying the load
    data = _api(user).get(f"/api/endpoints/{ep.pk}/replicas/").json()
    by = {r["url"]: r for r in data["replicas"]}
    assert data["runs"] == 2 and data["in_rotation"] == 1
    assert by[dead]["state"] == "out" and "cannot connect" in by[dead]["reason"] and by[dead]["since"]
    assert by[live.url]["state"] == "in" and by[live.url]["ok"] == n_tasks * N_REPEATS
    assert by[dead]["requests"] == dead_attempts and by[live.url]["share"] >= 0.9
    client.force_login(user)
    html = client.get(f"/endpoints/{ep.pk}/").content.decode()
    assert 'id="replica-load-table"' in html
    row = html.split(f'data-url="{dead}"', 1)[1].split("</tr>", 1)[0]
    assert "out of rotation" in row and "cannot connect" in row
    row = html.split(f'data-url="{live.url}"', 1)[1].split("</tr>", 1)[0]
    assert "in rotation" in row and f'<td class="replica-requests">{by[live.url]["requests"]}</td>' in row


@pytest.mark.e2e
@pytest.mark.timeout(150)
@pytest.mark.django_db(transaction=True)
def test_replica_that_dies_mid_job_and_comes_back_gets_traffic_again(user, math_dataset, sim_endpoint,
                                                                     simulator_factory, tmp_path, settings):
    settings.REPLICA_LOAD_WINDOW_S = 600
    knobs = dict(ttft_ms=100, itl_ms=1, output_len_min=8, output_len_max=16)
    a = simulator_factory(seed=22, **knobs)
    b = simulator_factory(seed=23, **knobs)
    n_tasks = 300
    ep = sim_endpoint(a.url, owner=user, replica_urls=[b.url], max_retries=3)
    job = services.create_job(owner=user, dataset=math_dataset(n_tasks), endpoint=ep, num_repeats=N_REPEATS,
                              chunk_size=150, num_samples_in_parallel=16, launch=False)
    state = {}

    def kill_then_restart():
        b.proc.kill()
        b.proc.wait(5)
        time.sleep(2.0)
        state["b2"] = start_simulator("--port", str(b.port), seed=24, **knobs)
        state["back_at"] = time.time()

    def during(job):
        if "thread" not in state and Rollout.objects.filter(job=job).count() >= 200:
            state["thread"] = threading.Thread(target=kill_then_restart, daemon=True)
            state["thread"].start()
            state["killed_at_rows"] = Rollout.objects.filter(job=job).count()

    try:
        job = _run_job(job, tmp_path, during=during)
        state["thread"].join(20)
        b2 = state["b2"]
        assert job.state == JobState.COMPLETED, job.error_message
        assert state["killed_at_rows"] < 0.5 * n_tasks * N_REPEATS, "the kill landed late: slow the simulators down"
        _assert_exactly_once(job, n_tasks)
        served_again = _served(b2)
        assert served_again >= 50, served_again  # back in rotation, it got traffic again
        tables = _final_replica_tables(job)
        back = [r for t in tables for r in t if r["url"] == b.url]
        assert all(r["times_out"] >= 1 for r in back), back  # every run saw it die...
        assert all(r["state"] == "in" for r in back), back  # ...and come back
        assert _served(a) + sum(r["ok"] for r in back) == n_tasks * N_REPEATS
        print(f"\nb died after {state['killed_at_rows']} rows; served {served_again} after coming back; a served {_served(a)}")
        data = _api(user).get(f"/api/endpoints/{ep.pk}/replicas/").json()
        by = {r["url"]: r for r in data["replicas"]}
        # "in", or "idle" once the finished runs' last ticks are older than RUN_FRESH_S (a loaded machine takes
        # that long to get here): the final tables above say every run had it back in rotation
        assert by[b.url]["state"] in ("in", "idle") and by[b.url]["times_out"] >= 2 and data["in_rotation"] == 2, by
    finally:
        if "b2" in state:
            state["b2"].stop()
