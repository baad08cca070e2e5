"""controlplane.leases: the one lease protocol of chunks, verification runs and ops actions (the chunk's own
paths through runtime.acquire_lease / release_lease and the watchdog are in test_jobs_services.py)."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.endpoints.models import ADMIN_ACTION_CLAIM, AdminAction
from controlplane.jobs import services
from controlplane.jobs.models import CHUNK_LEASE, JobChunk
from controlplane.leases import HeartbeatThread

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint(sim_endpoint):
    return sim_endpoint("http://127.0.0.1:9")


@pytest.fixture
def chunk(user, math_dataset, endpoint):
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=endpoint, launch=False)
    return job.chunks.get()


def test_a_holder_that_heartbeats_keeps_its_row_from_the_watchdog(chunk, settings):
    settings.JOBS_LEASE_TIMEOUT_S = 5
    assert CHUNK_LEASE.claim(chunk.pk, "w1#a")
    old = timezone.now() - timedelta(seconds=6)
    JobChunk.objects.filter(pk=chunk.pk).update(heartbeat_at=old)
    assert list(CHUNK_LEASE.expired().values_list("pk", flat=True)) == [chunk.pk]
    assert CHUNK_LEASE.beat(chunk.pk, "w1#a")  # the holder heartbeats after the watchdog read the row ...
    assert not CHUNK_LEASE.reclaim(chunk.pk, "w1#a", old)  # ... so the watchdog's reclaim does nothing
    chunk.refresh_from_db()
    assert (chunk.state, chunk.lease_owner) == ("running", "w1#a")
    assert not CHUNK_LEASE.expired().exists()


def test_a_reclaimed_row_is_lost_to_its_old_holder(chunk, settings):
    settings.JOBS_LEASE_TIMEOUT_S = 5
    assert CHUNK_LEASE.claim(chunk.pk, "w1#a")
    old = timezone.now() - timedelta(seconds=6)
    JobChunk.objects.filter(pk=chunk.pk).update(heartbeat_at=old)
    assert CHUNK_LEASE.reclaim(chunk.pk, "w1#a", old)
    chunk.refresh_from_db()
    assert (chunk.state, chunk.lease_owner, chunk.heartbeat_at) == ("pending", "w1#a", old)  # remembers its holder
    assert not CHUNK_LEASE.beat(chunk.pk, "w1#a")  # pending: the old holder's beat says the lease is lost
    assert CHUNK_LEASE.claim(chunk.pk, "w2#b")
    assert not CHUNK_LEASE.held(chunk.pk, "w1#a").update(state="done")  # its writes are refused
    assert not CHUNK_LEASE.release(chunk.pk, "w1#a")
    chunk.refresh_from_db()
    assert (chunk.state, chunk.lease_owner, chunk.attempts) == ("running", "w2#b", 2)


def test_an_admin_action_is_claimed_once_even_when_it_has_run_long(endpoint):
    action = AdminAction.objects.create(endpoint=endpoint, trace_id="t1", kind="pause", params={"mode": "keep"})
    now = timezone.now()
    assert ADMIN_ACTION_CLAIM.claim(action.pk, now=now, started_at=now)
    action.refresh_from_db()
    assert (action.state, action.started_at) == (AdminAction.State.RUNNING, now)
    # no heartbeat: a redelivered message never takes a running action, however old
    AdminAction.objects.filter(pk=action.pk).update(started_at=now - timedelta(days=1))
    assert not ADMIN_ACTION_CLAIM.claim(action.pk)


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_thread_keeps_the_lease_fresh_until_stopped(chunk, settings):
    settings.JOBS_LEASE_TIMEOUT_S = 2  # a beat every 0.5 s
    assert CHUNK_LEASE.claim(chunk.pk, "w1#a")
    old = timezone.now() - timedelta(seconds=60)
    JobChunk.objects.filter(pk=chunk.pk).update(heartbeat_at=old)
    beat = HeartbeatThread(CHUNK_LEASE, chunk.pk, "w1#a", name="test-heartbeat")
    beat.start()
    try:
        deadline = time.monotonic() + 10
        while JobChunk.objects.get(pk=chunk.pk).heartbeat_at == old and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        beat.stop.set()
        beat.join(5)
    assert JobChunk.objects.get(pk=chunk.pk).heartbeat_at > old
    assert not beat.is_alive()
