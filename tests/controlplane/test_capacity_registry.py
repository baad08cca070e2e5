"""The fair share's registry of worker slots in Redis: read in one round trip whatever else Redis holds. It was a
key per worker found with SCAN, which walks the whole keyspace: at 1.15M keys (the verification cache's, one per
rollout verified) every few chunk starts waited 1.1-1.6 s for it, and a worker's rate fell as jobs grew."""
from __future__ import annotations

import uuid

import pytest
import redis

from controlplane.jobs import capacity


@pytest.fixture
def queue(settings):
    name = f"registry-{uuid.uuid4().hex[:8]}"
    capacity._slots_cache.clear()
    yield name
    capacity._slots_cache.clear()
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(capacity._slot_key(name))
    client.close()


def test_live_workers_slots_are_summed_and_a_stopped_worker_leaves(queue):
    capacity.register_slots("w1@host", [queue], 2)
    capacity.register_slots("w2@host", [queue, "elsewhere-" + queue], 3)
    assert capacity.collection_slots(queue) == 5
    capacity.unregister_slots("w2@host", [queue, "elsewhere-" + queue])
    capacity._slots_cache.clear()
    assert capacity.collection_slots(queue) == 2


def test_a_worker_that_died_without_leaving_counts_until_its_registration_expires(queue, monkeypatch):
    capacity.register_slots("gone@host", [queue], 4, ttl_s=30)
    capacity.register_slots("alive@host", [queue], 1, ttl_s=90)
    later = capacity.time.time() + 60
    monkeypatch.setattr(capacity.time, "time", lambda: later)
    assert capacity.collection_slots(queue) == 1


def test_reading_the_registry_is_one_round_trip_whatever_redis_holds(queue, settings, monkeypatch):
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    prefix = f"test-unrelated-{uuid.uuid4().hex[:8]}:"
    try:
        with client.pipeline(transaction=False) as pipe:  # a verification cache's worth of other keys
            for i in range(20_000):
                pipe.set(f"{prefix}{i}", b"x", ex=300)
            pipe.execute()
        capacity.register_slots("w1@host", [queue], 2)
        commands = []
        real = redis.Redis.execute_command

        def counted(self, *args, **kwargs):
            commands.append(args[0])
            return real(self, *args, **kwargs)

        monkeypatch.setattr(redis.Redis, "execute_command", counted)
        assert capacity.collection_slots(queue) == 2
        assert len(commands) <= 2, commands[:5]  # SCAN took 40 round trips here, 2,300 at 1.15M keys
    finally:
        monkeypatch.undo()
        keys = [f"{prefix}{i}" for i in range(20_000)]
        for k in range(0, len(keys), 5000):
            client.delete(*keys[k:k + 5000])
        client.close()
