"""The scenario suite: real runs on the simulator (real HTTP), each configured to be bound by one thing,
diagnosed from the telemetry the run produced. Each run takes a few seconds."""


import pytest
from workers.diagnosis import CONTROL_PLANE, MODEL, NETWORK, VERIFICATION, diagnose_ticks
from workers.diagnosis.scenarios import LoopBlockingSink, rows_math, task_items, use_scenario_verify_pool
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, EndpointSpec
from workers.telemetry import Telemetry, TelemetrySink


def spec_for(sim, **kw):
    ep = EndpointSpec(base_urls=[sim.url], model=sim.model, max_retries=2, backoff_base_s=0.05, backoff_max_s=0.3,
                      request_timeout_s=30)
    kw.setdefault("progress_interval_s", 0.25)
    return CollectionSpec(endpoint=ep, **kw)


async def run_and_diagnose(sim, spec, n, config=None, wrap=None):
    telemetry = Telemetry(metrics_urls=spec.endpoint.base_urls, scrape_interval_s=0.5, sample_interval_s=0.25)
    inner = wrap(None) if wrap else None
    sink = TelemetrySink(inner, telemetry)
    summary = await run_collection(spec, task_items(rows_math(n)), sink)
    cfg = {"parallelism": spec.parallelism, "verifier": spec.verifier}
    cfg.update(config or {})
    d = diagnose_ticks(list(sink.history), config=cfg)
    print(explain(d))
    return summary, d


def explain(d):
    return f"{d.verdict} {d.scores} held={[(i.name, i.value) for i in d.held()]}"


@pytest.mark.slow
async def test_model_bound_small_capacity_long_generation(simulator_factory):
    sim = simulator_factory(seed=1, ttft_ms=40, itl_ms=8, jitter=0.05, max_num_seqs=8, output_len_min=40, output_len_max=40)
    spec = spec_for(sim, parallelism=32, verifier="exact", responses_create_params={"max_output_tokens": 40})
    summary, d = await run_and_diagnose(sim, spec, 96, config={"max_num_seqs": 8, "max_model_len": 32768})
    assert summary.completed == 96
    assert d.verdict == MODEL, explain(d)
    assert d.subtype == "server_saturated"
    held = {i.name for i in d.held()}
    assert "model_share" in held and ("server_waiting_frac" in held or "running_vs_max_num_seqs" in held)
    # every slot busy, KV cache nearly empty: more slots, not KV tuning; parallelism within the 8 slots
    assert d.recommendations[0].setting == "max_num_seqs"
    text = " ".join(r.action for r in d.recommendations)
    assert "gpu_memory_utilization" not in text
    assert [r.value for r in d.recommendations if r.setting == "num_samples_in_parallel"] == [8]


@pytest.mark.slow
async def test_model_bound_with_room_says_raise_parallelism(simulator_factory):
    sim = simulator_factory(seed=2, ttft_ms=40, itl_ms=8, jitter=0.05, max_num_seqs=256, output_len_min=40, output_len_max=40)
    spec = spec_for(sim, parallelism=4, verifier="exact", responses_create_params={"max_output_tokens": 40})
    summary, d = await run_and_diagnose(sim, spec, 40, config={"max_num_seqs": 256})
    assert d.verdict == MODEL, explain(d)
    assert d.subtype == "client_parallelism"
    assert d.recommendations[0].setting == "num_samples_in_parallel" and d.recommendations[0].value == 8


@pytest.mark.slow
async def test_rate_limited_rpm_mode(simulator_factory):
    sim = simulator_factory(seed=3, ttft_ms=30, itl_ms=2, jitter=0.05, output_len_min=10, output_len_max=10,
                            rpm_limit=120, retry_after_s=1)
    spec = spec_for(sim, parallelism=16, verifier="exact")
    summary, d = await run_and_diagnose(sim, spec, 200, config={"rpm_limit": 120})
    assert summary.failed > 0  # the budget ran out: 429s past the retry budget
    assert d.verdict == NETWORK, explain(d)
    assert "rate_429" in {i.name for i in d.held()}
    rec = d.recommendations[0]
    assert rec.setting == "num_samples_in_parallel" and "120/60" in rec.action
    assert rec.value >= 1


@pytest.mark.slow
async def test_verification_bound_slow_verifier_fast_model(simulator_factory):
    use_scenario_verify_pool(1)
    sim = simulator_factory(seed=4, ttft_ms=5, itl_ms=1, jitter=0, output_len_min=8, output_len_max=8)
    spec = spec_for(sim, parallelism=16, verifier="burn", verifier_options={"burn_ms": 30}, verify_processes=1)
    summary, d = await run_and_diagnose(sim, spec, 90)
    assert summary.completed == 90, summary
    assert d.verdict == VERIFICATION, explain(d)
    assert "verify_share" in {i.name for i in d.held()}
    text = " ".join(r.action for r in d.recommendations)
    assert "lru_cache" in text and "verify_mode = fast" in text and "deferred" in text


@pytest.mark.slow
async def test_control_plane_bound_sink_blocks_the_loop(simulator_factory):
    sim = simulator_factory(seed=5, ttft_ms=5, itl_ms=1, jitter=0, output_len_min=8, output_len_max=8)
    spec = spec_for(sim, parallelism=32, verifier="none")
    summary, d = await run_and_diagnose(sim, spec, 150, wrap=lambda inner: LoopBlockingSink(inner, block_ms=25))
    assert summary.completed == 150
    assert d.verdict == CONTROL_PLANE, explain(d)
    assert "loop_lag_p99_ms" in {i.name for i in d.held()}
    assert "event loop" in d.recommendations[0].action


@pytest.mark.slow
async def test_verification_bound_verifier_blocking_the_loop(simulator_factory):
    sim = simulator_factory(seed=6, ttft_ms=5, itl_ms=1, jitter=0, output_len_min=8, output_len_max=8)
    spec = spec_for(sim, parallelism=16, verifier="burn_inline", verifier_options={"burn_ms": 25})
    summary, d = await run_and_diagnose(sim, spec, 100)
    assert summary.completed == 100
    assert d.verdict == VERIFICATION, explain(d)
    assert "process pool" in d.recommendations[0].action
