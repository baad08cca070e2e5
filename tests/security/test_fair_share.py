"""Fair capacity: one user's hanging jobs do not hold another user's job queued. Alice's jobs point at a server
that never answers and take every slot of a real Celery worker (-c 2) while she is alone; when bob's job arrives,
alice's chunks over her share (ceil(2 slots / 2 users) = 1) give their lease back and wait, and bob's job runs
to its end against the simulator while alice's keep hanging."""
from __future__ import annotations

import uuid

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobChunk, JobState
from tests.factories import make_dataset, make_endpoint, make_user

from .slow_servers import Worker, hanging_server, send_chunks, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


def _held(owner):
    return JobChunk.objects.filter(job__owner=owner, state=JobChunk.State.RUNNING).count()


def test_hanging_jobs_of_one_user_do_not_hold_another_users_job(simulator, tmp_path):
    hang = hanging_server()
    alice, bob = make_user("alice"), make_user("bob")
    queue = f"fair-{uuid.uuid4().hex[:10]}"
    worker = Worker(queue, tmp_path, concurrency=2, JOBS_FAIR_SHARE_CHECK_S=1, JOBS_FAIR_SHARE_RETRY_S=1)
    try:
        ep_hang = make_endpoint(alice, hang.url, request_timeout_s=600, max_retries=0)
        alice_jobs = [services.create_job(owner=alice, dataset=make_dataset(alice, n=2), endpoint=ep_hang,
                                          num_samples_in_parallel=2, launch=False) for _ in range(4)]
        for job in alice_jobs:
            send_chunks(job, queue)
        # alone, alice may use every slot
        wait_for(lambda: _held(alice) == 2, 60, "alice's chunks did not take both slots", worker.tail)

        ep_sim = make_endpoint(bob, simulator.url, model=simulator.model)
        bob_job = services.create_job(owner=bob, dataset=make_dataset(bob, n=8), endpoint=ep_sim,
                                      num_samples_in_parallel=4, launch=False)
        send_chunks(bob_job, queue)

        def bob_done():
            bob_job.refresh_from_db()
            assert _held(alice) <= 2
            return bob_job.state == JobState.COMPLETED

        wait_for(bob_done, 60, "bob's job was held behind alice's hanging chunks", worker.tail)
        assert bob_job.completed_count == 8
        # alice's work is still there (held or waiting), none of it failed or lost
        assert all(j.state in JobState.RUNNABLE for j in CollectionJob.objects.filter(owner=alice))
        assert JobChunk.objects.filter(job__owner=alice).exclude(state=JobChunk.State.DONE).count() == 4
        # once bob has nothing left, alice gets the idle slot back
        wait_for(lambda: _held(alice) == 2, 60, "alice did not get the free slot back", worker.tail)
    finally:
        for job in CollectionJob.objects.filter(owner=alice, state__in=JobState.RUNNABLE):
            services.cancel_job(job)
        worker.stop()
        hang.close()
