"""Jobs services without a model server: transitions, create_job, idempotency, retry_failed, counts,
leases, the watchdog, and exactly-once batch writes."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.utils import timezone

from controlplane.jobs import runtime, services
from controlplane.jobs.models import CollectionJob, InvalidTransition, JobChunk, JobState, Rollout
from workers.engine.types import RolloutResult

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint(sim_endpoint):
    return sim_endpoint("http://127.0.0.1:9")


def make_job(user, ds, endpoint, **kw):
    kw.setdefault("launch", False)
    return services.create_job(owner=user, dataset=ds, endpoint=endpoint, **kw)


def add_rollouts(job, pairs, status=Rollout.Status.OK):
    Rollout.objects.bulk_create([Rollout(job=job, task_index=t, rollout_index=r, status=status,
                                         data={"reward": 1.0 if status == "ok" else 0.0, "_ng_task_index": t},
                                         reward=1.0 if status == "ok" else None,
                                         failure_class="" if status == "ok" else "timeout") for t, r in pairs])


# --- state machine ----------------------------------------------------------------------------------
def test_transitions_and_invalid_ones(user, math_dataset, endpoint):
    job = make_job(user, math_dataset(5), endpoint)
    assert job.state == JobState.QUEUED
    services.pause_job(job)
    assert CollectionJob.objects.get(pk=job.pk).state == JobState.PAUSED
    with pytest.raises(InvalidTransition):
        services.pause_job(job)  # already paused
    services.resume_job(job, launch=False)
    assert job.state == JobState.QUEUED
    services.cancel_job(job)
    assert job.state == JobState.CANCELLED and job.finished_at is not None
    with pytest.raises(InvalidTransition, match="cannot cancel a job that is cancelled"):
        services.cancel_job(job)
    with pytest.raises(InvalidTransition):
        services.pause_job(job)
    services.resume_job(job, launch=False)  # a cancelled job can be resumed
    assert job.state == JobState.QUEUED and job.finished_at is None
    with pytest.raises(InvalidTransition):
        services.retry_failed(job)  # only finished jobs
    job.mark_running()
    job.complete()
    for action in (services.cancel_job, services.pause_job):
        with pytest.raises(InvalidTransition):
            action(job)
    with pytest.raises(InvalidTransition):
        services.resume_job(job)  # a completed job is not resumed (retry_failed is)


# --- create_job ---------------------------------------------------------------------------------------
def test_create_job_chunks_and_totals(user, math_dataset, endpoint):
    ds = math_dataset(1234)
    job = make_job(user, ds, endpoint, num_repeats=3, chunk_size=500)
    assert job.total_rollouts == 1234 * 3
    assert list(job.chunks.order_by("index").values_list("index", "start_row", "end_row", "state")) == [
        (0, 0, 500, "pending"), (1, 500, 1000, "pending"), (2, 1000, 1234, "pending")]

    limited = make_job(user, ds, endpoint, limit=700, num_repeats=2, chunk_size=500)
    assert limited.total_rollouts == 1400
    assert list(limited.chunks.values_list("start_row", "end_row")) == [(0, 500), (500, 700)]

    over = make_job(user, ds, endpoint, limit=10_000, chunk_size=5000)
    assert over.total_rollouts == 1234 and over.chunks.count() == 1


def test_create_job_idempotency_key_per_owner(user, math_dataset, endpoint, django_user_model):
    ds = math_dataset(10)
    first = make_job(user, ds, endpoint, idempotency_key="ci-run-42")
    again = make_job(user, ds, endpoint, idempotency_key="ci-run-42", num_repeats=5)
    assert again.pk == first.pk and again.num_repeats == 1
    other = django_user_model.objects.create_user(username="other")
    theirs = make_job(other, ds, endpoint, idempotency_key="ci-run-42")
    assert theirs.pk != first.pk
    assert CollectionJob.objects.count() == 2 and JobChunk.objects.count() == 2


@pytest.mark.parametrize("kw, field", [
    ({"num_repeats": 0}, "num_repeats"), ({"limit": 0}, "limit"), ({"num_samples_in_parallel": 0}, "num_samples_in_parallel"),
    ({"chunk_size": 0}, "chunk_size"), ({"verifier": "no-such-verifier"}, "verifier"), ({"verify_mode": "later"}, "verify_mode"),
])
def test_create_job_validation(user, math_dataset, endpoint, kw, field):
    with pytest.raises(ValidationError) as err:
        make_job(user, math_dataset(3), endpoint, **kw)
    assert field in err.value.message_dict
    assert CollectionJob.objects.count() == 0


def test_create_job_rejects_dataset_not_ready(user, math_dataset, endpoint):
    ds = math_dataset(3)
    ds.status = ds.Status.VALIDATING
    ds.save()
    with pytest.raises(ValidationError, match="not ready"):
        make_job(user, ds, endpoint)


# --- counts, retry_failed ---------------------------------------------------------------------------------
def test_refresh_counts_and_retry_failed(user, math_dataset, endpoint):
    job = make_job(user, math_dataset(10), endpoint, num_repeats=2, chunk_size=4)
    add_rollouts(job, [(t, r) for t in range(10) for r in range(2) if (t, r) not in {(3, 1), (7, 0)}])
    add_rollouts(job, [(3, 1), (7, 0)], status=Rollout.Status.FAILED)
    services.refresh_counts(job)
    job.refresh_from_db()
    assert (job.completed_count, job.failed_count) == (18, 2)
    JobChunk.objects.filter(job=job).update(state=JobChunk.State.DONE)
    job.mark_running()
    services.finalize_job(job)
    assert job.state == JobState.COMPLETED
    assert job.aggregate_metrics["mean/reward"] == 1.0
    assert job.aggregate_metrics.get("num_rows") == 18

    services.retry_failed(job, launch=False)
    job.refresh_from_db()
    assert job.state == JobState.QUEUED and job.failed_count == 0 and job.completed_count == 18
    assert not Rollout.objects.filter(job=job, status="failed").exists()
    assert set(job.chunks.values_list("state", flat=True)) == {"pending"}


def test_finalize_waits_for_every_chunk(user, math_dataset, endpoint):
    job = make_job(user, math_dataset(10), endpoint, chunk_size=5)
    job.mark_running()
    JobChunk.objects.filter(job=job, index=0).update(state=JobChunk.State.DONE)
    services.finalize_job(job)
    assert job.state == JobState.RUNNING
    JobChunk.objects.filter(job=job).update(state=JobChunk.State.DONE)
    services.finalize_job(job)
    assert job.state == JobState.COMPLETED


# --- leases and watchdog ------------------------------------------------------------------------------------
def test_lease_is_exclusive_until_stale(user, math_dataset, endpoint, settings):
    settings.JOBS_LEASE_TIMEOUT_S = 30
    job = make_job(user, math_dataset(4), endpoint)
    chunk = job.chunks.get()
    assert runtime.acquire_lease(chunk.pk, "w1#a")
    assert not runtime.acquire_lease(chunk.pk, "w2#b")  # live holder
    JobChunk.objects.filter(pk=chunk.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=31))
    assert runtime.acquire_lease(chunk.pk, "w2#b")  # holder stopped heartbeating
    chunk.refresh_from_db()
    assert chunk.lease_owner == "w2#b" and chunk.attempts == 2
    assert not runtime.release_lease(chunk.pk, "w1#a")  # the old holder cannot give it back
    assert runtime.release_lease(chunk.pk, "w2#b")


def test_watchdog_reclaims_stale_chunks_and_flags_stalled_jobs(user, math_dataset, endpoint, settings):
    settings.JOBS_LEASE_TIMEOUT_S = 5
    settings.JOBS_STALL_AFTER_S = 60
    endpoint.request_timeout_s, endpoint.connect_timeout_s = 30, 1  # the stall threshold is never below one request
    endpoint.save()
    job = make_job(user, math_dataset(10), endpoint, chunk_size=5)
    job.mark_running()
    c0, c1 = job.chunks.order_by("index")
    now = timezone.now()
    JobChunk.objects.filter(pk=c0.pk).update(state="running", lease_owner="dead#1", heartbeat_at=now - timedelta(seconds=6))
    JobChunk.objects.filter(pk=c1.pk).update(state="running", lease_owner="live#1", heartbeat_at=now)
    CollectionJob.objects.filter(pk=job.pk).update(last_progress_at=now - timedelta(seconds=61))
    report = runtime.watchdog(dispatch=False)
    assert report["reclaimed"] == [c0.pk] and report["stalled"] == [job.pk]
    c0.refresh_from_db(), c1.refresh_from_db(), job.refresh_from_db()
    assert (c0.state, c0.lease_owner) == ("pending", "dead#1") and c1.state == "running"  # remembers its last holder
    assert job.stalled and job.stall_reason.startswith("no progress for 61 s: ")
    # progress clears the flag; a finished set of chunks is finalized by the safety path
    JobChunk.objects.filter(job=job).update(state="done")
    report = runtime.watchdog(dispatch=False)
    job.refresh_from_db()
    assert report["finalized"] == [job.pk] and job.state == JobState.COMPLETED and not job.stalled


# --- exactly-once writes ---------------------------------------------------------------------------------------
def _result(t, r, ok=True):
    return RolloutResult(task_index=t, rollout_index=r, ok=ok, output_row={"q": t, "reward": 1.0 if ok else 0.0},
                         reward=1.0 if ok else 0.0, failure_class="" if ok else "http_5xx", wall_ms=10.0)


def test_batch_write_counts_only_inserted_rows(user, math_dataset, endpoint):
    from controlplane.jobs.sink import DbSink

    job = make_job(user, math_dataset(10), endpoint, num_repeats=2)
    chunk = job.chunks.get()
    assert runtime.acquire_lease(chunk.pk, "w#1")
    sink = DbSink(job=job, chunk=chunk, lease_owner="w#1", worker_name="w", db=None, channel_layer=False)
    ok, failed, row, lease_ok = sink._write_batch([_result(0, 0), _result(0, 1), _result(1, 0, ok=False)])
    assert (ok, failed, lease_ok) == (2, 1, True)
    assert (row["completed_count"], row["failed_count"]) == (2, 1)
    # the same rows again (a rerun after a crash) plus one new: only the new one counts
    ok, failed, row, _ = sink._write_batch([_result(0, 0), _result(0, 1), _result(1, 0, ok=False), _result(1, 1)])
    assert (ok, failed) == (1, 0)
    assert (row["completed_count"], row["failed_count"]) == (3, 1)
    assert Rollout.objects.filter(job=job).count() == 4
    # a NUL character (PostgreSQL rejects it in text/jsonb) is cleaned, not fatal
    bad = _result(2, 0)
    bad.output_row["response"] = "a\x00b"
    bad.error = "x\x00"
    ok, _, _, _ = sink._write_batch([bad])
    assert ok == 1
    stored = Rollout.objects.get(job=job, task_index=2).data["response"]
    assert stored == ("a\ufffdb" if connection.vendor == "postgresql" else "a\x00b")  # SQLite keeps NUL
    # after the lease moved on, the write still lands (exactly once) but reports the lost lease
    JobChunk.objects.filter(pk=chunk.pk).update(lease_owner="other#2")
    _, _, _, lease_ok = sink._write_batch([_result(3, 0)])
    assert lease_ok is False


@pytest.mark.django_db(transaction=True)
def test_rows_are_stamped_stored_once_the_jobs_insert_lock_is_held(user, math_dataset, endpoint):
    """Another chunk's sink holds the job's insert lock: this batch waits, and its store time is when it got the
    lock, not when it started to wait (a rate read during the wait would count rows not yet visible)."""
    import threading

    from django.db import connections, transaction

    from controlplane.jobs.sink import DbSink
    from controlplane.jobs.stream import lock_job_for_insert

    if connection.vendor != "postgresql":
        pytest.skip("row locks: PostgreSQL")
    job = make_job(user, math_dataset(10), endpoint)
    chunk = job.chunks.get()
    assert runtime.acquire_lease(chunk.pk, "w#1")
    held, released = threading.Event(), []

    def other_writer():
        try:
            with transaction.atomic():
                lock_job_for_insert(job.pk)
                held.set()
                time.sleep(0.8)
                released.append(timezone.now())
        finally:
            connections.close_all()

    t = threading.Thread(target=other_writer)
    t.start()
    assert held.wait(10)
    asked = timezone.now()
    sink = DbSink(job=job, chunk=chunk, lease_owner="w#1", worker_name="w", db=None, channel_layer=False)
    sink._write_batch([_result(0, 0), _result(1, 0)])
    t.join(10)
    stored = set(Rollout.objects.filter(job=job).values_list("created_at", flat=True))
    assert len(stored) == 1 and stored.pop() >= released[0] > asked
