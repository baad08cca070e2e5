"""The engine's verifier pool: warmed before the first request, fed in batches, errors per rollout."""
from __future__ import annotations

import asyncio
import pytest

from workers.engine.materialize import materialize
from workers.profiling import core as profiling_core
from workers.engine.runner import run_collection
from workers.engine.verify_pool import (
    RemoteVerifierError, VerifyBatcher, VerifyPool, get_verify_pool, shutdown_verify_pool,
)
from workers.verifiers.execution import verify_items

from .test_engine import ListSink, math_rows, spec_for


def test_verify_batch_reports_each_item_in_order():
    out = verify_items([("math", {"expected_answer": "7"}, "so \\boxed{7}", {}, False),
                        ("nope", {}, "x", {}, False),
                        ("math", {"expected_answer": "7"}, "so \\boxed{8}", {}, False)])
    assert [o[0] for o in out] == [True, False, True]
    assert out[0][1].reward == 1.0 and out[2][1].reward == 0.0
    assert out[1][1] == "ValueError" and "nope" in out[1][2]


@pytest.mark.slow
async def test_batcher_matches_results_to_rollouts_and_batches_under_load(monkeypatch):
    # batches go out unwrapped: no profiling session, nor the grace period after one that ended earlier in
    # this process (its wrapped calls carry more arguments than the counting submit below expects)
    monkeypatch.setattr(profiling_core, "_ACTIVE", None)
    monkeypatch.setattr(profiling_core, "_GRACE_UNTIL", 0.0)
    batcher = VerifyBatcher(asyncio.get_running_loop(), 1, max_batch=16)
    submits = []
    real_submit = get_verify_pool(1).submit

    def counting_submit(fn, items):
        submits.append(len(items))
        return real_submit(fn, items)

    pool = get_verify_pool(1)
    pool.submit = counting_submit
    try:
        futs = [batcher.verify("math", {"expected_answer": str(i)}, f"\\boxed{{{i if i % 3 else i + 1}}}", {}, False)
                for i in range(60)]
        futs.append(batcher.verify("nope", {}, "x", {}, False))
        results = await asyncio.gather(*futs, return_exceptions=True)
    finally:
        del pool.submit
    assert [r.reward for r in results[:60]] == [1.0 if i % 3 else 0.0 for i in range(60)]
    assert isinstance(results[60], RemoteVerifierError) and results[60].type_name == "ValueError"
    assert sum(submits) == 61 and len(submits) < 61 and max(submits) <= 16  # batched, never over max_batch
    assert batcher.inflight == 0 and not batcher.pending


async def _submitted_batches(monkeypatch, processes: int, n: int, max_batch: int = 32) -> list[int]:
    """The sizes of the batches a burst of n verifications went out in, on a pool of `processes`."""
    monkeypatch.setattr(profiling_core, "_ACTIVE", None)
    monkeypatch.setattr(profiling_core, "_GRACE_UNTIL", 0.0)
    batcher = VerifyBatcher(asyncio.get_running_loop(), processes, max_batch=max_batch)
    pool = get_verify_pool(processes)
    real_submit, submits = pool.submit, []
    monkeypatch.setattr(pool, "submit", lambda fn, items: submits.append(len(items)) or real_submit(fn, items))
    futs = [batcher.verify("math", {"expected_answer": str(i)}, f"\\boxed{{{i}}}", {}, False) for i in range(n)]
    assert [r.reward for r in await asyncio.gather(*futs)] == [1.0] * n
    return submits


@pytest.mark.slow
async def test_a_burst_goes_out_in_small_batches_a_backlog_in_full_ones(monkeypatch):
    # 64 answers landing at once (a 200 ms model latency) on 2 processes: no batch holds more than 1/SPREAD
    # of a process's share of what waits, so results come back as batches finish, not in two halves
    burst = await _submitted_batches(monkeypatch, 2, 64)
    share = -(-61 // (2 * VerifyBatcher.SPREAD))  # 61 wait once the first 3 have gone out alone
    assert sum(burst) == 64 and max(burst) <= share < 32 and len(burst) >= 3 + 61 // share, burst
    # a backlog far bigger than the pool (a CPU-bound run): batches fill up to max_batch
    backlog = await _submitted_batches(monkeypatch, 1, 300)
    assert sum(backlog) == 300 and max(backlog) == 32, backlog


@pytest.mark.slow
async def test_pool_is_warm_before_the_first_request_and_verify_ms_is_clean(simulator):
    shutdown_verify_pool()  # a cold pool: processes start and import sympy / math-verify
    sink = ListSink()
    spec = spec_for(simulator, parallelism=8, verifier="math", verify_processes=2,
                    responses_create_params={"max_output_tokens": 16})
    summary = await run_collection(spec, materialize(math_rows(16), 1), sink)
    assert summary.completed == 16 and not summary.fatal_error
    assert getattr(get_verify_pool(2), "_engine_warm", False)
    # the cold start (~3 s: forkserver imports sympy / math-verify) happened before any task was read:
    # no rollout's queue, wall or verify time includes it
    assert max(r.verify_ms for r in sink.results) < 1500, [round(r.verify_ms) for r in sink.results]
    assert max(r.queue_ms + r.wall_ms for r in sink.results) < 1500, [round(r.queue_ms + r.wall_ms) for r in sink.results]
    assert all(r.reward in (0.0, 1.0) for r in sink.results)


async def test_cancel_while_the_pool_warms_stops_promptly(simulator):
    from .test_engine import ScriptedControl

    shutdown_verify_pool()
    sink = ListSink()
    spec = spec_for(simulator, parallelism=4, verifier="math", verify_processes=1)
    control = ScriptedControl().at(0.0, action="cancel")
    summary = await asyncio.wait_for(run_collection(spec, materialize(math_rows(50), 1), sink, control), 30)
    assert summary.cancelled and not sink.results and sink.closed


@pytest.mark.slow
async def test_a_run_given_its_own_pool_uses_it_and_leaves_the_shared_one_alone(simulator):
    shutdown_verify_pool()
    own = VerifyPool()
    try:
        sink = ListSink()
        spec = spec_for(simulator, parallelism=4, verifier="math", verify_processes=1,
                        responses_create_params={"max_output_tokens": 16})
        summary = await run_collection(spec, materialize(math_rows(8), 1), sink, verify_pool=own)
        assert summary.completed == 8 and not summary.fatal_error
        assert getattr(own.executor(1), "_engine_warm", False)  # warmed and used: the run's own pool
        assert all(r.reward in (0.0, 1.0) for r in sink.results)
        from workers.engine.verify_pool import SHARED_VERIFY_POOL
        assert SHARED_VERIFY_POOL._executor is None  # never started
    finally:
        own.shutdown()
