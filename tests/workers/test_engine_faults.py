"""Retries, backoff, Retry-After, budgets, timeouts, dropped connections, unreachable endpoints."""
from __future__ import annotations

import socket
import time
import pytest

from workers.engine.materialize import materialize
from workers.engine.pacing import backoff_delay, parse_retry_after
from workers.engine.runner import run_collection
from workers.engine.types import FailureClass

from .test_engine import ListSink, math_rows, spec_for


@pytest.mark.slow
async def test_429_is_retried_honouring_retry_after(simulator):
    simulator.configure(fault_rates={"429": 0.4}, retry_after_s=1)
    sink = ListSink()
    # the exponential backoff alone would wait ~10 ms: waits of >= 1 s can only come from Retry-After
    spec = spec_for(simulator, parallelism=8, max_retries=8, backoff_base_s=0.01, backoff_max_s=2.0)
    summary = await run_collection(spec, materialize(math_rows(20), 1), sink)
    assert summary.completed == 20 and summary.failed == 0
    retried = [r for r in sink.results if r.attempts > 1]
    assert retried, "seeded fault draws should hit some requests"
    for r in retried:
        assert r.wall_ms >= 1000 * (r.attempts - 1) * 0.99, (r.attempts, r.wall_ms)
    assert sum(t.errors.get(FailureClass.HTTP_429, 0) for t in sink.ticks) == sum(r.attempts - 1 for r in sink.results)


async def test_5xx_retried_then_success(simulator):
    simulator.configure(fault_rates={"500": 0.3, "503": 0.2}, retry_after_s=0)
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, parallelism=8, max_retries=10, backoff_max_s=0.02),
                                   materialize(math_rows(30), 1), sink)
    assert summary.completed == 30 and summary.failed == 0
    assert any(r.attempts > 1 for r in sink.results)
    errors = sum(t.errors.get(FailureClass.HTTP_5XX, 0) for t in sink.ticks)
    assert errors == sum(r.attempts - 1 for r in sink.results) > 0


async def test_budget_exhausted_gives_failed_rows_with_their_class_and_the_run_goes_on(simulator):
    simulator.configure(fault_rates={"500": 1.0})
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, max_retries=2), materialize(math_rows(5), 1), sink)
    assert summary.failed == 5 and summary.completed == 0 and not summary.fatal_error  # reachable: not fatal
    for r in sink.results:
        assert not r.ok and r.failure_class == FailureClass.HTTP_5XX and r.attempts == 3
        assert "HTTP 500" in r.error and "after 2 retries" in r.error
        assert "response" not in r.output_row and r.output_row["_ng_task_index"] == r.task_index
    # then the server heals: the same spec succeeds
    simulator.configure(fault_rates={})
    sink = ListSink()
    assert (await run_collection(spec_for(simulator, max_retries=2), materialize(math_rows(5), 1), sink)).completed == 5


async def test_400_is_not_retried(simulator):
    simulator.configure(fault_rates={"400": 1.0})
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, max_retries=5), materialize(math_rows(3), 1), sink)
    assert summary.failed == 3
    assert all(r.failure_class == FailureClass.HTTP_4XX and r.attempts == 1 for r in sink.results)


@pytest.mark.slow
async def test_stalled_server_is_cut_off_by_the_timeout(simulator):
    simulator.configure(fault_rates={"stall": 1.0})
    sink = ListSink()
    t0 = time.monotonic()
    spec = spec_for(simulator, request_timeout_s=0.5, max_retries=1, parallelism=4)
    summary = await run_collection(spec, materialize(math_rows(4), 1), sink)
    elapsed = time.monotonic() - t0
    assert summary.failed == 4 and not summary.fatal_error
    assert elapsed < 3.0, elapsed  # 2 attempts x 0.5 s each, in parallel
    for r in sink.results:
        assert r.failure_class == FailureClass.TIMEOUT and r.attempts == 2 and "timed out" in r.error


async def test_stalled_stream_is_cut_off_by_the_read_timeout(simulator_factory):
    # tokens every 2 s: the stream starts, then goes silent longer than read_timeout_s
    sim = simulator_factory(ttft_ms=0, itl_ms=2000, jitter=0)
    sink = ListSink()
    t0 = time.monotonic()
    spec = spec_for(sim, request_timeout_s=30, read_timeout_s=0.4, max_retries=0,
                    responses_create_params={"max_output_tokens": 10})
    summary = await run_collection(spec, materialize(math_rows(2), 1), sink)
    assert time.monotonic() - t0 < 2.0
    assert summary.failed == 2 and all(r.failure_class == FailureClass.TIMEOUT for r in sink.results)


async def test_dropped_connection_is_classified_connection(simulator):
    simulator.configure(fault_rates={"drop": 1.0})
    for stream in (True, False):
        sink = ListSink()
        summary = await run_collection(spec_for(simulator, stream=stream, max_retries=1), materialize(math_rows(3), 1), sink)
        # the server was reached (it answered, then dropped): rows are recorded, the run is not fatal
        assert summary.failed == 3 and not summary.fatal_error, summary
        assert all(r.failure_class == FailureClass.CONNECTION and r.attempts == 2 for r in sink.results)


async def test_drops_are_retried_to_success(simulator):
    simulator.configure(fault_rates={"drop": 0.3})
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, max_retries=10), materialize(math_rows(20), 1), sink)
    assert summary.completed == 20 and any(r.attempts > 1 for r in sink.results)
    assert sum(t.errors.get(FailureClass.CONNECTION, 0) for t in sink.ticks) > 0


def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


async def test_unreachable_endpoint_is_fatal_and_emits_nothing(simulator):
    url = f"http://127.0.0.1:{_closed_port()}"
    sink = ListSink()
    t0 = time.monotonic()
    spec = spec_for(simulator, base_urls=[url], max_retries=3, parallelism=4)
    summary = await run_collection(spec, materialize(math_rows(50), 2), sink)
    assert time.monotonic() - t0 < 3
    assert sink.results == [] and summary.completed == 0 and summary.failed == 0 and sink.closed
    assert summary.fatal_error.startswith(f"cannot reach {url}: ")
    assert "after 3 retries" in summary.fatal_error and "refused" in summary.fatal_error.lower(), summary.fatal_error
    assert not summary.cancelled and not summary.paused


async def test_endpoint_dying_mid_run_records_failures_instead_of_failing_the_run(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0)
    sink = ListSink()

    class StopAfterFirst(ListSink):
        async def rollout(self, result):
            await super().rollout(result)
            if len(self.results) == 3:
                sim.stop()
    sink = StopAfterFirst()
    summary = await run_collection(spec_for(sim, parallelism=1, max_retries=1), materialize(math_rows(6), 1), sink)
    # the request after the third may have been answered before the server stopped (verification holds no
    # request slot); every later one fails, and the run goes on to the end
    assert summary.completed in (3, 4) and summary.completed + summary.failed == 6 and not summary.fatal_error
    assert all(r.failure_class == FailureClass.CONNECTION for r in sink.results[summary.completed:])


def test_backoff_and_retry_after_parsing():
    assert parse_retry_after("3") == 3.0 and parse_retry_after("  0.5 ") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    from email.utils import formatdate
    assert 8 <= parse_retry_after(formatdate(time.time() + 10, usegmt=True)) <= 10.5
    assert parse_retry_after(formatdate(time.time() - 100, usegmt=True)) == 0.0
    for attempt in range(8):
        d = backoff_delay(attempt, 0.5, 30)
        cap = min(30, 0.5 * 2 ** attempt)
        assert cap / 2 <= d <= cap
    assert 20 <= backoff_delay(0, 0.5, 20, retry_after=120) <= 22  # capped
    assert 2 <= backoff_delay(5, 0.5, 30, retry_after=2) <= 2.2
