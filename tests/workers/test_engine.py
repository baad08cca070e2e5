"""The engine against the simulator over real HTTP: output shape, rewards, flavors, timings, usage."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from workers.engine.materialize import materialize
from workers.engine.runner import run_collection, run_collection_sync
from workers.engine.types import CollectionSpec, ControlState, EndpointSpec, FailureClass
from workers.verifiers import VerifyResult, Verifier, register


class ListSink:
    """Keeps every result and tick (tests only: real sinks batch to a database)."""

    def __init__(self):
        self.results = []
        self.ticks = []
        self.closed = False

    async def rollout(self, result):
        self.results.append(result)

    async def progress(self, tick):
        self.ticks.append(tick)

    async def close(self):
        self.closed = True

    def by_index(self):
        return {(r.task_index, r.rollout_index): r for r in self.results}


class ScriptedControl:
    """poll() returns whatever `state` is now; `at(t, state)` schedules a change t seconds after the first poll."""

    def __init__(self):
        self.state = ControlState()
        self.plan: list[tuple[float, ControlState]] = []
        self.t0 = None
        self.polls = 0
        self.lock = threading.Lock()

    def at(self, t: float, **kw):
        self.plan.append((t, ControlState(**kw)))
        return self

    def poll(self):
        with self.lock:
            self.polls += 1
            now = time.monotonic()
            if self.t0 is None:
                self.t0 = now
            for t, st in self.plan:
                if now - self.t0 >= t:
                    self.state = st
            return self.state


def math_rows(n, seed=0):
    rng = random.Random(seed)
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        yield i, {"responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + {b}?"}]},
                  "question": f"What is {a} + {b}?", "expected_answer": str(a + b), "extra_field": {"keep": i}}


def spec_for(sim, **kw):
    ep_kw = {k: kw.pop(k) for k in list(kw) if k in EndpointSpec.__dataclass_fields__ and k not in ("model",)}
    ep_kw.setdefault("backoff_base_s", 0.01)
    ep_kw.setdefault("backoff_max_s", 0.05)
    base_urls = ep_kw.pop("base_urls", None) or [sim.url]
    kw.setdefault("progress_interval_s", 0.2)
    kw.setdefault("verifier", "exact")
    return CollectionSpec(endpoint=EndpointSpec(base_urls=base_urls, model=sim.model, **ep_kw), **kw)


@pytest.mark.slow
async def test_happy_path_streaming_math_rewards_and_output_shape(simulator):
    sink = ListSink()
    spec = spec_for(simulator, parallelism=8, verifier="math", verify_processes=1,
                    responses_create_params={"temperature": 0.7, "max_output_tokens": 40})
    summary = await run_collection(spec, materialize(math_rows(30), 2), sink)
    assert summary.completed == 60 and summary.failed == 0 and not summary.fatal_error
    assert not summary.cancelled and not summary.paused and sink.closed
    keys = sink.by_index()
    assert sorted(keys) == [(t, r) for t in range(30) for r in range(2)]
    rewards = [r.reward for r in sink.results]
    assert set(rewards) <= {0.0, 1.0} and 0.4 <= sum(rewards) / len(rewards) <= 0.95  # simulator accuracy 0.7
    r = keys[(3, 1)]
    row = r.output_row
    assert r.ok and r.attempts == 1 and r.failure_class == "" and r.weight_version == "0"
    assert row["_ng_task_index"] == 3 and row["_ng_rollout_index"] == 1 and row["extra_field"] == {"keep": 3}
    assert row["responses_create_params"]["temperature"] == 0.7
    assert row["responses_create_params"]["max_output_tokens"] == 40
    assert row["reward"] == r.reward and "extracted_answer" in row and "library_reward" in row
    resp = row["response"]
    assert resp["status"] == "completed" and resp["incomplete_details"] is None
    msg = resp["output"][-1]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"][0]["type"] == "output_text" and "\\boxed{" in msg["content"][0]["text"]
    usage = resp["usage"]
    assert usage["output_tokens"] == 40 == r.output_tokens  # the override reached the server
    assert usage["input_tokens"] > 0 and usage["input_tokens"] == r.input_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert "cached_tokens" in usage["input_tokens_details"] and "reasoning_tokens" in usage["output_tokens_details"]
    for res in sink.results:
        assert res.queue_ms >= 0 and res.ttft_ms > 0 and res.generation_ms >= 0 and res.verify_ms > 0
        assert res.wall_ms >= res.ttft_ms
    assert sink.ticks and sink.ticks[-1].completed == 60
    # the input rows were not modified by the override merge
    assert "temperature" not in next(math_rows(1))[1]["responses_create_params"]


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["chat_completions", "completions", "responses"])
@pytest.mark.parametrize("stream", [False, True])
async def test_every_flavor_plain_and_streaming(simulator, flavor, stream):
    sink = ListSink()
    spec = spec_for(simulator, api_flavor=flavor, stream=stream, parallelism=4, verifier="exact",
                    responses_create_params={"max_output_tokens": 30})
    summary = await run_collection(spec, materialize(math_rows(6), 1), sink)
    assert summary.completed == 6, [r.error for r in sink.results]
    for r in sink.results:
        text = r.output_row["response"]["output"][-1]["content"][0]["text"]
        assert "boxed" in text
        assert r.output_tokens == 30 and r.input_tokens > 0
        assert r.reward in (0.0, 1.0) and r.output_row["extracted_answer"]
        assert r.weight_version == "0"
        if stream:
            assert r.generation_ms is not None
        else:
            assert r.generation_ms is None


@pytest.mark.slow
async def test_ttft_and_generation_time_are_measured_when_streaming(simulator_factory):
    sim = simulator_factory(ttft_ms=150, itl_ms=10, jitter=0, seed=1)
    sink = ListSink()
    spec = spec_for(sim, parallelism=4, verifier="none", responses_create_params={"max_output_tokens": 20})
    summary = await run_collection(spec, materialize(math_rows(4), 1), sink)
    assert summary.completed == 4
    for r in sink.results:
        assert 140 <= r.ttft_ms < 600, r.ttft_ms
        assert 19 * 10 * 0.8 <= r.generation_ms < 19 * 10 * 4, r.generation_ms  # 19 gaps between 20 tokens
        assert r.reward is None and "reward" not in r.output_row  # verifier "none": nothing scored now
    # not streaming: ttft is the whole latency and there is no generation split
    sink2 = ListSink()
    spec.stream = False
    await run_collection(spec, materialize(math_rows(2), 1), sink2)
    for r in sink2.results:
        assert r.ttft_ms >= 150 + 19 * 10 * 0.8 and r.generation_ms is None


async def test_deferred_mode_skips_verification_and_fast_mode_uses_heuristic(simulator):
    sink = ListSink()
    await run_collection(spec_for(simulator, verifier="math", verify_mode="deferred"), materialize(math_rows(3), 1), sink)
    assert all(r.ok and r.reward is None and r.verify_ms is None for r in sink.results)
    sink = ListSink()
    await run_collection(spec_for(simulator, verifier="math", verify_mode="fast"), materialize(math_rows(10), 1), sink)
    assert all(r.ok and r.reward in (0.0, 1.0) and "library_reward" not in r.output_row for r in sink.results)


class _Exploding(Verifier):
    name = "test_exploding"

    def verify(self, row, response_text, options):
        if row["_explode"]:
            raise RuntimeError("kaboom")
        return VerifyResult(reward=1.0, fields={"seen": len(response_text)})


register(_Exploding)


async def test_verifier_that_raises_gives_verifier_error_rows_and_the_run_completes(simulator):
    rows = [(i, {"responses_create_params": {"input": "hello"}, "_explode": i % 2 == 0}) for i in range(6)]
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, verifier="test_exploding"), materialize(rows, 1), sink)
    assert summary.completed == 3 and summary.failed == 3 and not summary.fatal_error
    for r in sink.results:
        if r.task_index % 2 == 0:
            assert not r.ok and r.failure_class == FailureClass.VERIFIER_ERROR and "kaboom" in r.error
            assert r.reward == 0.0 and r.output_row["reward"] == 0.0 and r.output_row["response"]["output"]
        else:
            assert r.ok and r.reward == 1.0 and r.output_row["seen"] > 0
    assert sum(t.errors.get(FailureClass.VERIFIER_ERROR, 0) for t in sink.ticks) == 3


async def test_unknown_verifier_is_a_clear_fatal_error(simulator):
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, verifier="nope"), materialize(math_rows(2), 1), sink)
    assert "unknown verifier 'nope'" in summary.fatal_error and not sink.results and sink.closed


async def test_bad_input_row_is_a_failed_row_not_a_crash(simulator):
    rows = [(0, {"responses_create_params": {"input": [{"role": "wizard", "content": "x"}]}}),
            (1, {"responses_create_params": {"input": "fine"}})]
    sink = ListSink()
    summary = await run_collection(spec_for(simulator, verifier="none"), materialize(rows, 1), sink)
    assert summary.completed == 1 and summary.failed == 1
    bad = sink.by_index()[(0, 0)]
    assert bad.failure_class == FailureClass.BAD_INPUT and "wizard" in bad.error and bad.attempts == 0


async def test_api_key_sent_and_a_wrong_one_is_a_4xx_not_retried(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, api_key="s3cret")
    sink = ListSink()
    summary = await run_collection(spec_for(sim, api_key="s3cret"), materialize(math_rows(3), 1), sink)
    assert summary.completed == 3
    sink = ListSink()
    summary = await run_collection(spec_for(sim, api_key="wrong"), materialize(math_rows(3), 1), sink)
    assert summary.failed == 3 and not summary.fatal_error
    assert all(r.failure_class == FailureClass.HTTP_4XX and r.attempts == 1 and "401" in r.error for r in sink.results)


async def test_replicas_share_the_load_and_v1_suffix_is_accepted(simulator_factory):
    a = simulator_factory(ttft_ms=5, itl_ms=0)
    b = simulator_factory(ttft_ms=5, itl_ms=0)
    sink = ListSink()
    spec = spec_for(a, base_urls=[a.url + "/v1", b.base_url], parallelism=4, verifier="none")
    summary = await run_collection(spec, materialize(math_rows(40), 1), sink)
    assert summary.completed == 40

    def served(sim):
        return sum(float(line.rsplit(" ", 1)[1]) for line in sim.metrics_text().splitlines()
                   if line.startswith("vllm:request_success_total"))
    sa, sb = served(a), served(b)
    assert sa + sb == 40 and sa >= 10 and sb >= 10, (sa, sb)


async def test_async_iterable_and_sync_wrapper(simulator):
    async def agen():
        for item in materialize(math_rows(5), 1):
            await asyncio.sleep(0)
            yield item
    sink = ListSink()
    assert (await run_collection(spec_for(simulator), agen(), sink)).completed == 5

    sink = ListSink()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("s", run_collection_sync(
        spec_for(simulator), list(materialize(math_rows(5), 1)), sink)))
    t.start()
    t.join(30)
    assert result["s"].completed == 5


@pytest.mark.slow
async def test_client_side_rpm_pacing(simulator):
    sink = ListSink()
    spec = spec_for(simulator, rpm_limit=1200, parallelism=16, verifier="none")  # 20/s, bursts of 20
    t0 = time.monotonic()
    summary = await run_collection(spec, materialize(math_rows(40), 1), sink)
    elapsed = time.monotonic() - t0
    assert summary.completed == 40
    assert elapsed >= 0.9, elapsed  # 20 at once, then 20 more at 20/s
    assert max(r.queue_ms for r in sink.results) >= 800


@pytest.mark.slow
def test_cli_writes_nemo_gym_outputs(simulator, tmp_path):
    import json
    import subprocess
    import sys
    src = tmp_path / "tasks.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for _, row in math_rows(5)))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "workers.engine", "--input", str(src), "--output", str(out),
                           "--base-url", simulator.url, "--model", simulator.model, "--num-repeats", "2", "--limit", "4",
                           "--verifier", "exact", "--max-output-tokens", "20", "--quiet"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows) == [(t, k) for t in range(4) for k in range(2)]
    assert (tmp_path / "out_failures.jsonl").read_text() == ""
    metrics = json.loads((tmp_path / "out_aggregate_metrics.json").read_text())
    assert metrics["num_rows"] == 8 and "mean/reward" in metrics and "pass@2" in metrics and metrics["mean/output_tokens"] == 20
    assert metrics["timing"]["wall_ms"]["count"] == 8


async def test_a_tick_says_since_when_the_run_has_been_at_work():
    from workers.engine.runner import CollectionRun

    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=["http://127.0.0.1:9"], model="m"), parallelism=4)
    run = CollectionRun(spec, ListSink(), None)
    assert run.tick().extra["busy_s"] == 0  # nothing sent yet
    run._slot_taken(time.monotonic() - 2.0)  # the first request, 2 s before a late first tick
    run._slot_taken(time.monotonic() - 1.0)
    assert run.tick().extra["busy_s"] == pytest.approx(2.0, abs=0.2)
    assert run.tick().extra["busy_s"] == pytest.approx(2.0, abs=0.2)  # the same stretch, still at work
    run.in_flight = 0  # everything came back: the next request begins a new stretch
    run.tick()
    run._slot_taken(time.monotonic() - 0.5)
    assert run.tick().extra["busy_s"] == pytest.approx(0.5, abs=0.2)
