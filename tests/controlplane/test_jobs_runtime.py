"""The jobs runtime against the simulator: the inline path (same code as the Celery task), exactly-once,
progress on the real Redis channel layer, unreachable and stalled servers, cancel and pause."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from django.db.models import Count

from controlplane.jobs import services
from controlplane.jobs.runtime import run_job_inline
from controlplane.jobs.events import job_group
from controlplane.jobs.models import CollectionJob, JobChunk, JobMetricSample, JobState, Rollout

pytestmark = pytest.mark.django_db(transaction=True)


def new_job(user, ds, endpoint, **kw):
    kw.setdefault("launch", False)
    kw.setdefault("num_samples_in_parallel", 8)
    return services.create_job(owner=user, dataset=ds, endpoint=endpoint, **kw)


def pairs_are_unique(job):
    return not (Rollout.objects.filter(job=job).values("task_index", "rollout_index")
                .annotate(n=Count("id")).filter(n__gt=1).exists())


def run_in_thread(fn, *args, **kwargs):
    box = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # surfaced by the test
            box["error"] = exc
        finally:
            from django.db import connection

            connection.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def run_and_close(fn, *args, **kwargs):
    """Run fn in this (pool) thread and close the thread's DB connection after."""
    from django.db import connection

    try:
        return fn(*args, **kwargs)
    finally:
        connection.close()


def wait_for(predicate, timeout=30.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


@pytest.mark.slow
def test_inline_run_end_to_end(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=1, ttft_ms=1, itl_ms=0)
    job = new_job(user, math_dataset(40), sim_endpoint(sim.url), num_repeats=2, chunk_size=15,
                  responses_create_params={"max_output_tokens": 24, "temperature": 0.5})
    seen = []
    job = run_job_inline(job, on_progress=seen.append)

    assert job.state == JobState.COMPLETED, job.error_message
    assert job.chunks.count() == 3 and set(job.chunks.values_list("state", flat=True)) == {"done"}
    rollouts = Rollout.objects.filter(job=job)
    assert rollouts.count() == 80 == job.total_rollouts == job.completed_count + job.failed_count
    assert job.completed_count == 80 and pairs_are_unique(job)
    assert sorted(set(rollouts.values_list("rollout_index", flat=True))) == [0, 1]
    one = rollouts.get(task_index=5, rollout_index=1)
    assert one.data["_ng_task_index"] == 5 and one.data["_ng_rollout_index"] == 1
    assert one.data["expected_answer"] and "response" in one.data and one.reward in (0.0, 1.0)
    assert one.data["responses_create_params"]["temperature"] == 0.5  # the job's overrides were merged
    assert one.wall_ms is not None and one.output_tokens and one.worker
    # rewards: the simulator answers right ~70% of the time
    assert 0.4 < job.aggregate_metrics["mean/reward"] < 0.95
    assert "pass@1" in job.aggregate_metrics or "pass@2" in job.aggregate_metrics
    assert set(job.timing_summary) >= {"queue_ms", "ttft_ms", "generation_ms", "verify_ms", "wall_ms"}
    assert job.timing_summary["wall_ms"]["count"] == 80 and job.timing_summary["wall_ms"]["p50"] is not None
    assert JobMetricSample.objects.filter(job=job).exists() or job.finished_at
    assert seen and seen[-1]["type"] == "job.progress" and seen[-1]["done"] == 80
    assert {"job_id", "state", "total", "completed", "failed", "done", "in_flight", "parallelism", "samples_per_s",
            "output_tokens_per_s", "eta_s", "errors", "t", "stalled"} <= set(seen[-1])


@pytest.mark.slow
def test_metric_samples_written_while_running(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=2, ttft_ms=300, itl_ms=0)
    job = new_job(user, math_dataset(24), sim_endpoint(sim.url), num_samples_in_parallel=4)
    job = run_job_inline(job)  # ~6 waves of 300 ms: a couple of progress ticks
    assert job.state == JobState.COMPLETED
    samples = list(JobMetricSample.objects.filter(job=job).order_by("t"))
    assert len(samples) >= 1
    assert samples[-1].completed == 24 and samples[-1].parallelism == 4 and samples[-1].worker


@pytest.mark.slow
def test_rerun_is_exactly_once(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=3, ttft_ms=1, itl_ms=0)
    job = new_job(user, math_dataset(30), sim_endpoint(sim.url), num_repeats=2, chunk_size=10)
    job = run_job_inline(job)
    assert job.state == JobState.COMPLETED and Rollout.objects.filter(job=job).count() == 60
    first_ids = set(Rollout.objects.filter(job=job).values_list("id", flat=True))

    # a crash mid-chunk looks like this: some rows of a chunk missing, the chunk not done
    Rollout.objects.filter(job=job, task_index__in=[11, 12], rollout_index=1).delete()
    JobChunk.objects.filter(job=job, index=1).update(state="pending")
    JobChunk.objects.filter(job=job, index=2).update(state="pending")  # this one is complete in the table
    CollectionJob.objects.filter(pk=job.pk).update(state=JobState.RUNNING)
    job.refresh_from_db()
    job = run_job_inline(job)

    assert job.state == JobState.COMPLETED
    assert Rollout.objects.filter(job=job).count() == 60 and pairs_are_unique(job)
    new_ids = set(Rollout.objects.filter(job=job).values_list("id", flat=True)) - first_ids
    assert sorted(Rollout.objects.filter(pk__in=new_ids).values_list("task_index", "rollout_index")) == [(11, 1), (12, 1)]
    assert job.completed_count + job.failed_count == 60  # counters recomputed, nothing double counted


@pytest.mark.slow
def test_progress_messages_reach_the_channel_layer(user, math_dataset, sim_endpoint, simulator_factory):
    from channels.layers import get_channel_layer

    sim = simulator_factory(seed=4, ttft_ms=150, itl_ms=0)
    job = new_job(user, math_dataset(60), sim_endpoint(sim.url), num_samples_in_parallel=4)  # ~2.5 s

    async def scenario():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(job_group(job.pk), channel)
        try:
            await asyncio.sleep(0.2)  # the subscription is live before the run starts
            runner = asyncio.create_task(asyncio.to_thread(run_and_close, run_job_inline, job))
            messages = []
            while True:
                try:
                    msg = await asyncio.wait_for(layer.receive(channel), timeout=10)
                except asyncio.TimeoutError:
                    break
                messages.append(msg)
                if msg["state"] == JobState.COMPLETED:
                    break
            await runner
            return messages
        finally:
            await layer.group_discard(job_group(job.pk), channel)

    messages = asyncio.run(scenario())
    assert messages, "no progress message arrived"
    assert all(m["type"] == "job.progress" and m["job_id"] == job.pk for m in messages)
    assert messages[-1]["state"] == "completed" and messages[-1]["done"] == 60 == messages[-1]["total"]
    running = [m for m in messages if m["state"] == "running"]
    assert running and max(m["done"] for m in running) > 0
    assert any(m["in_flight"] > 0 for m in running)
    # coalesced: a few seconds of run at <= 4 messages/s (plus the state changes)
    span = messages[-1]["t"] - messages[0]["t"]
    assert len(messages) <= 4 * span + 6


@pytest.mark.slow
def test_unreachable_endpoint_fails_the_job_with_a_clear_message(user, math_dataset, sim_endpoint):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = sim_endpoint(f"http://127.0.0.1:{port}", max_retries=2, connect_timeout_s=1)
    job = new_job(user, math_dataset(10), endpoint)
    t0 = time.monotonic()
    job = run_job_inline(job, resume=False)
    assert time.monotonic() - t0 < 20
    assert job.state == JobState.FAILED
    assert f"127.0.0.1:{port}" in job.error_message and "after 2 retries" in job.error_message
    assert job.error_message.startswith("Collection stopped: cannot reach")
    assert Rollout.objects.filter(job=job).count() == 0
    assert job.chunks.get().state == "pending"  # resumable


@pytest.mark.slow
def test_stalled_server_is_cut_off_by_the_timeout(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=5, ttft_ms=1, itl_ms=0, fault_rates={"stall": 0.3})
    endpoint = sim_endpoint(sim.url, request_timeout_s=1.0, max_retries=0)
    job = new_job(user, math_dataset(30), endpoint, num_samples_in_parallel=30)
    t0 = time.monotonic()
    job = run_job_inline(job)
    assert time.monotonic() - t0 < 15
    assert job.state == JobState.COMPLETED, job.error_message
    timeouts = Rollout.objects.filter(job=job, status="failed", failure_class="timeout")
    assert timeouts.exists() and job.failed_count == timeouts.count()
    assert job.completed_count + job.failed_count == 30 == Rollout.objects.filter(job=job).count()


@pytest.mark.slow
def test_cancel_stops_a_running_job_within_two_seconds(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=6, ttft_ms=5000, itl_ms=0)  # every request takes 5 s
    job = new_job(user, math_dataset(200), sim_endpoint(sim.url), num_samples_in_parallel=16)
    thread, box = run_in_thread(run_job_inline, job)
    assert wait_for(lambda: CollectionJob.objects.get(pk=job.pk).state == JobState.RUNNING, 20)
    time.sleep(0.5)
    t0 = time.monotonic()
    services.cancel_job(CollectionJob.objects.get(pk=job.pk))
    thread.join(10)
    elapsed = time.monotonic() - t0
    assert not thread.is_alive() and "error" not in box
    assert elapsed < 2.5, f"cancel took {elapsed:.1f}s"
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert job.chunks.get().state == "pending" and Rollout.objects.filter(job=job).count() == 0


@pytest.mark.slow
def test_pause_then_resume_completes_exactly_once(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=7, ttft_ms=100, itl_ms=0)
    job = new_job(user, math_dataset(120), sim_endpoint(sim.url), num_samples_in_parallel=8, chunk_size=40)
    thread, box = run_in_thread(run_job_inline, job, resume=False)
    assert wait_for(lambda: Rollout.objects.filter(job=job).count() >= 20, 30)
    services.pause_job(CollectionJob.objects.get(pk=job.pk))
    thread.join(15)
    assert not thread.is_alive() and "error" not in box
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
    partial = Rollout.objects.filter(job=job).count()
    assert 20 <= partial < 120
    assert not job.chunks.filter(state="running").exists()

    job = run_job_inline(job)  # resumes (the CLI rerun)
    assert job.state == JobState.COMPLETED
    assert Rollout.objects.filter(job=job).count() == 120 and pairs_are_unique(job)
    assert job.completed_count + job.failed_count == 120


@pytest.fixture
def celery_eager():
    """Tasks run in this process when sent (the dispatch path, without a worker; the e2e test has real ones)."""
    from controlplane.celery import app

    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield app
    app.conf.task_always_eager = before


@pytest.mark.slow
def test_launch_dispatches_one_task_per_chunk(user, math_dataset, sim_endpoint, simulator_factory, celery_eager):
    sim = simulator_factory(seed=8, ttft_ms=1, itl_ms=0)
    job = services.create_job(owner=user, dataset=math_dataset(25), endpoint=sim_endpoint(sim.url),
                              chunk_size=10, launch=True)
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and job.completed_count + job.failed_count == 25
    assert list(job.chunks.values_list("attempts", flat=True)) == [1, 1, 1]
    assert all(job.chunks.values_list("dispatched_at", flat=True))
    # a duplicate message for a finished chunk is a no-op
    from controlplane.jobs.tasks import run_chunk_task

    assert run_chunk_task.delay(job.chunks.first().pk).get() == "skipped"
    # retry_failed with nothing failed re-runs the chunks and stores nothing new
    services.retry_failed(job)
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and Rollout.objects.filter(job=job).count() == 25
