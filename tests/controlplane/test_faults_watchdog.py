"""The watchdog flags a running job that stops making progress, after max(JOBS_STALL_AFTER_S, one request
timeout of its endpoint), and says why on the job page: a model server that does not answer (a real hung
simulator), chunks held by a worker whose heartbeat stopped, or chunks no worker takes."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from rest_framework.test import APIClient
from django.test import Client
from django.utils import timezone

from controlplane.jobs import runtime, services
from controlplane.jobs.events import job_progress
from controlplane.jobs.models import CollectionJob, JobChunk, JobMetricSample, JobState, Rollout

from .test_jobs_runtime import new_job, run_in_thread, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _page(user, job):
    client = Client()
    client.force_login(user)
    r = client.get(f"/jobs/{job.pk}/")
    assert r.status_code == 200
    return r.content.decode()


@pytest.mark.slow
def test_hung_model_server_is_named_on_the_job_page(user, math_dataset, sim_endpoint, simulator_factory, settings):
    settings.JOBS_STALL_AFTER_S = 1
    sim = simulator_factory(seed=1, fault_rates={"stall": 1.0})  # every request hangs
    endpoint = sim_endpoint(sim.url, request_timeout_s=1.0, connect_timeout_s=1.0, max_retries=20)
    job = new_job(user, math_dataset(20), endpoint, num_samples_in_parallel=4)
    thread, box = run_in_thread(runtime.run_job_inline, job)
    try:
        assert wait_for(lambda: CollectionJob.objects.get(pk=job.pk).state == JobState.RUNNING, 20)
        assert runtime.watchdog(dispatch=False)["stalled"] == []  # under one request timeout (2 s): not yet
        # the engine's progress ticks (stored as metric samples) show requests in flight and timing out
        assert wait_for(lambda: JobMetricSample.objects.filter(job=job, in_flight__gt=0).exists()
                        and any(s.errors for s in JobMetricSample.objects.filter(job=job)), 20)
        time.sleep(max(0.0, 2.5 - (timezone.now() - CollectionJob.objects.get(pk=job.pk).started_at).total_seconds()))
        report = runtime.watchdog(dispatch=False)
        job.refresh_from_db()
        assert report["stalled"] == [job.pk] and job.stalled, report
        assert job.stall_reason.startswith("no progress for "), job.stall_reason
        assert "model server not answering" in job.stall_reason and "timeout" in job.stall_reason, job.stall_reason
        assert "requests in flight" in job.stall_reason and "is alive" in job.stall_reason
        page = _page(user, job)
        assert job.stall_reason in page.replace("&#x27;", "'")
        assert job_progress(job)["stall_reason"] == job.stall_reason  # the live message carries it too
        api = APIClient()
        api.force_authenticate(user)
        assert api.get(f"/api/jobs/{job.pk}/").json()["stall_reason"] == job.stall_reason  # and the API
    finally:
        services.cancel_job(CollectionJob.objects.get(pk=job.pk))
        thread.join(30)
    assert not thread.is_alive() and "error" not in box
    assert Rollout.objects.filter(job=job).count() == 0  # nothing was written: the server never answered


def test_dead_worker_and_missing_worker_are_named_and_progress_clears_the_flag(user, math_dataset, sim_endpoint,
                                                                              settings):
    settings.JOBS_LEASE_TIMEOUT_S = 30
    settings.JOBS_STALL_AFTER_S = 300
    endpoint = sim_endpoint("http://127.0.0.1:9", request_timeout_s=60, connect_timeout_s=5)
    job = new_job(user, math_dataset(10), endpoint, chunk_size=5)
    job.mark_running()
    c0, c1 = job.chunks.order_by("index")
    now = timezone.now()
    JobChunk.objects.filter(job=job).update(state="running", lease_owner="gpu-host-1:4242:celery:7#ab12",
                                            heartbeat_at=now - timedelta(seconds=20))
    CollectionJob.objects.filter(pk=job.pk).update(last_progress_at=now - timedelta(seconds=299))
    assert runtime.watchdog(now=now, dispatch=False)["stalled"] == []  # 299 s < 300 s

    later = now + timedelta(seconds=30)  # 329 s without a rollout; the heartbeat stopped 50 s ago (> lease)
    job.refresh_from_db()
    assert runtime.diagnose_stall(job, later) == (
        "no progress for 5 min: all chunks leased by worker gpu-host-1:4242:celery:7 whose heartbeat stopped 50 s "
        "ago; they are handed out again once the lease expires (30 s)")
    report = runtime.watchdog(now=later, dispatch=False)  # reclaims both chunks, then flags the job
    job.refresh_from_db()
    assert sorted(report["reclaimed"]) == [c0.pk, c1.pk] and report["stalled"] == [job.pk]
    assert job.stalled and job.stall_reason == (
        "no progress for 5 min: 2 chunk(s) wait for a worker and none has taken them; they were leased by worker "
        f"gpu-host-1:4242:celery:7 whose heartbeat stopped 50 s ago: is a Celery worker running on queue "
        f"{settings.CELERY_TASK_DEFAULT_QUEUE!r}?")
    assert job.stall_reason in _page(user, job).replace("&#x27;", "'")

    # a stored batch clears the flag and the reason (the sink's counter update)
    from controlplane.jobs.sink import DbSink, DbThread
    from workers.engine.types import RolloutResult

    db = DbThread()
    try:
        sink = DbSink(job=job, chunk=c0, lease_owner="w#1", worker_name="w", db=db, channel_layer=False)
        sink._write_batch([RolloutResult(task_index=0, rollout_index=0, ok=True, output_row={"reward": 1.0},
                                         reward=1.0)])
    finally:
        db.close()
    job.refresh_from_db()
    assert not job.stalled and job.stall_reason == "" and Rollout.objects.filter(job=job).count() == 1
    assert '<p class="stall-reason" id="stall-reason" data-field="stall_reason"></p>' in _page(user, job)


def test_the_threshold_grows_with_the_endpoint_timeout(user, math_dataset, sim_endpoint, settings):
    settings.JOBS_STALL_AFTER_S = 300
    slow = sim_endpoint("http://127.0.0.1:9", request_timeout_s=900, connect_timeout_s=10)
    job = new_job(user, math_dataset(4), slow)
    job.mark_running()
    assert runtime.stall_after_s(job) == 910
    now = timezone.now()
    CollectionJob.objects.filter(pk=job.pk).update(last_progress_at=now - timedelta(seconds=600))
    assert runtime.watchdog(now=now, dispatch=False)["stalled"] == []  # 10 min < one request timeout
    assert runtime.watchdog(now=now + timedelta(seconds=311), dispatch=False)["stalled"] == [job.pk]


def test_a_broker_back_empty_gets_every_pending_chunk_again_while_others_run(user, math_dataset, sim_endpoint,
                                                                             settings, monkeypatch):
    """The broker's mark: gone once per loss (one caller sees it). While a chunk of the job runs, a pending chunk
    dispatched 5 s ago is not deemed lost (its message may wait in the queue), unless the broker lost its data."""
    import redis

    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(services.broker_mark_key())  # a Redis back with nothing saved
    assert services.broker_lost_its_data() is True
    assert services.broker_lost_its_data() is False  # seen once
    client.delete(services.broker_mark_key())
    assert services.broker_lost_its_data() is True
    settings.CELERY_BROKER_URL = "memory://"
    assert services.broker_lost_its_data() is False  # not a Redis broker: nothing to tell

    sent = []
    monkeypatch.setattr(services, "send_task", lambda name, *args, queue=None: sent.append((name, args)))
    job = new_job(user, math_dataset(10), sim_endpoint("http://127.0.0.1:9"), chunk_size=5)
    job.mark_running()
    c0, c1 = job.chunks.order_by("index")
    now = timezone.now()
    JobChunk.objects.filter(pk=c0.pk).update(state="running", lease_owner="w#1", heartbeat_at=now)
    JobChunk.objects.filter(pk=c1.pk).update(dispatched_at=now - timedelta(seconds=5))
    assert runtime.watchdog(now=now, broker_lost=False)["redispatched"] == [] and sent == []
    assert runtime.watchdog(now=now, broker_lost=True)["redispatched"] == [c1.pk]
    assert sent == [(services.RUN_CHUNK_TASK, (c1.pk,))]

    # a deferred verification run just sent: pending, left alone until the lost-message timeout, unless the
    # broker lost its data
    from controlplane.jobs import verification
    from controlplane.jobs.models import VerificationRun

    run = VerificationRun.objects.create(job=job, verifier="math")
    monkeypatch.setattr(verification, "dispatch", lambda r: sent.append(("verify", r.pk)))
    assert verification.reclaim_stale(broker_lost=False) == []
    assert verification.reclaim_stale(broker_lost=True) == [run.pk] and sent[-1] == ("verify", run.pk)
