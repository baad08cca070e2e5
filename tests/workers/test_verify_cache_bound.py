"""An executor's local verification cache keeps its LOCAL_MAX most recently used results, not every result of
its run (a chunk of 250,000 distinct rollouts grew the worker by ~0.7 KB each); identical requests in flight
are still computed once, and errors are not remembered (workers/verifiers/execution.py)."""
from __future__ import annotations

import asyncio

import pytest

from workers.verifiers.base import VerifyResult
from workers.verifiers.execution import VerifyExecutor

ROW = {"expected_answer": "4"}


def _executor(local_max):
    ex = VerifyExecutor("exact", None, cache="job", local_max=local_max)
    computed = []

    async def compute(row, text):
        computed.append(text)
        await asyncio.sleep(0.01)
        if text == "boom":
            raise RuntimeError("judge timed out")
        return VerifyResult(reward=1.0 if text == row["expected_answer"] else 0.0)

    ex._compute = compute
    return ex, computed


def test_the_local_cache_is_bounded_and_keeps_the_most_recent_results():
    async def main():
        ex, computed = _executor(local_max=3)
        results = await asyncio.gather(*(ex.verify(ROW, "4") for _ in range(5)))  # in flight together: once
        assert computed == ["4"] and [r.reward for r in results] == [1.0] * 5
        for text in ("a", "b", "c", "d"):
            await ex.verify(ROW, text)
        assert len(ex.cache) == 3 and not ex._inflight  # "4" dropped, the least recently used
        await ex.verify(ROW, "b")  # kept: a hit, and now the most recent
        await ex.verify(ROW, "e")  # drops "c"
        assert (await ex.verify(ROW, "4")).reward == 1.0  # dropped earlier: computed again
        await ex.verify(ROW, "b")
        assert computed == ["4", "a", "b", "c", "d", "e", "4"]
        assert list(ex.cache) == [ex.key(ROW, t) for t in ("e", "4", "b")]  # least recently used first
        assert ex.hits == 4 + 2 and ex.lookups == 5 + 4 + 4
        await ex.aclose()
    asyncio.run(main())


def test_errors_are_not_remembered_and_leave_nothing_in_flight():
    async def main():
        ex, computed = _executor(local_max=8)
        for _ in range(2):
            with pytest.raises(RuntimeError):
                await ex.verify(ROW, "boom")
        assert computed == ["boom", "boom"] and not ex.cache and not ex._inflight
        await ex.aclose()
    asyncio.run(main())
