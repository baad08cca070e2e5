"""The shared verification cache only where it pays: a run measures what a verification, a Redis lookup and a
store cost and how often Redis has the answer, then keeps the shared cache or goes on with its local one
(workers/verifiers/execution.py). Real Redis; the verifiers count their computations there."""
from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import redis

from workers.verifiers.execution import SHARED_PROBE, VerifyExecutor
from workers.verifiers.shared_cache import KEY_PREFIX

REDIS_URL = os.environ.get("TEST_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
ROW = {"expected_answer": "4"}


def _run(verifier, options, texts, scope, *, choice="measured", concurrency=32):
    async def main():
        ex = VerifyExecutor(verifier, options, cache="job", shared_url=REDIS_URL, shared_scope=scope,
                            concurrency=concurrency, shared_choice=choice)
        sem = asyncio.Semaphore(concurrency)

        async def one(t):
            async with sem:
                return await ex.verify(ROW, t)
        try:
            results = await asyncio.gather(*(one(t) for t in texts))
        finally:
            await ex.aclose()  # after the stores still going on in the background
        return results, ex.stats()

    return asyncio.run(main())


def _left_in_redis(scope) -> tuple[int, int]:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(r.scan_iter(f"{KEY_PREFIX}{scope}:*", count=1000))
    finally:
        r.close()
    return sum(not k.endswith(b":claim") for k in keys), sum(k.endswith(b":claim") for k in keys)


def test_a_cheap_verifier_with_no_hits_goes_local_after_the_probe(counter):
    key, computed = counter
    scope = f"test:{uuid.uuid4().hex}"
    texts = [f"The answer is \\boxed{{{i}}}" for i in range(2 * SHARED_PROBE)]  # all distinct: Redis never has one
    results, stats = _run("tests.verifier_plugins:counted", {"counter_url": REDIS_URL, "counter": key}, texts, scope)
    assert [r.reward for r in results] == [1.0 if i == 4 else 0.0 for i in range(len(texts))]
    assert computed() == len(texts)  # every one computed once, the local cache after the choice as before it
    assert stats["verify_cache_choice"].startswith("local: hits 0%"), stats
    assert stats["verify_cache_shared"] is False
    stored, claims = _left_in_redis(scope)
    assert SHARED_PROBE <= stored < len(texts)  # stores stopped with the choice ...
    assert claims == 0  # ... and every claim taken before it was stored, none left for others to wait on


def test_an_expensive_verifier_that_finds_half_its_answers_keeps_the_shared_cache(counter):
    key, computed = counter
    scope = f"test:{uuid.uuid4().hex}"
    options = {"counter_url": REDIS_URL, "counter": key, "sleep_s": 0.2}  # far above a Redis round trip, loaded or not
    first = [f"The answer is \\boxed{{{i}}}" for i in range(SHARED_PROBE)]
    _run("tests.verifier_plugins:counted_io", options, first, scope)  # another worker's run stored these
    texts = [f"The answer is \\boxed{{{i}}}" for i in range(SHARED_PROBE // 2, SHARED_PROBE // 2 + 2 * SHARED_PROBE)]
    results, stats = _run("tests.verifier_plugins:counted_io", options, texts, scope)
    assert [r.reward for r in results] == [1.0 if t.endswith("{4}") else 0.0 for t in texts]
    assert stats["verify_cache_choice"].startswith("shared: hits"), stats
    assert stats["verify_cache_shared"] is True and stats["verify_cache_shared_hits"] == SHARED_PROBE // 2
    assert computed() == SHARED_PROBE + len(texts) - SHARED_PROBE // 2  # nothing computed twice


def test_always_keeps_redis_whatever_it_costs(counter):
    key, computed = counter
    scope = f"test:{uuid.uuid4().hex}"
    texts = [f"The answer is \\boxed{{{i}}}" for i in range(2 * SHARED_PROBE)]
    _, stats = _run("tests.verifier_plugins:counted", {"counter_url": REDIS_URL, "counter": key}, texts, scope,
                    choice="always")
    assert "verify_cache_choice" not in stats and stats["verify_cache_shared"] is True
    assert stats["verify_cache_computed"] == len(texts) and _left_in_redis(scope) == (len(texts), 0)
    with pytest.raises(ValueError, match="measured or always|one of measured, always"):
        VerifyExecutor("math", {}, shared_choice="sometimes")
