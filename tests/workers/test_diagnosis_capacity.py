"""The scenario suite, held-out situations on the simulator (real HTTP, real telemetry): each run is put
into one bottleneck on purpose, then the diagnosis must name it and give a first step whose figure fits
the server (a parallelism figure never above what the server runs at once, summed over replicas)."""
import socket
import pytest

from workers.diagnosis import MODEL, NETWORK, rate_limit_parallelism
from workers.engine.types import CollectionSpec, EndpointSpec

from .test_diagnosis_scenarios import explain, run_and_diagnose


def spec_for(urls, model, timeout_s=30.0, **kw):
    ep = EndpointSpec(base_urls=list(urls), model=model, max_retries=2, backoff_base_s=0.05, backoff_max_s=0.3,
                      request_timeout_s=timeout_s)
    kw.setdefault("progress_interval_s", 0.25)
    return CollectionSpec(endpoint=ep, **kw)


def parallelism_figures(d):
    return [r.value for r in d.recommendations if r.setting == "num_samples_in_parallel" and r.value is not None]


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


@pytest.mark.slow
async def test_saturated_slots_two_replicas(simulator_factory):
    """Every slot busy (max_num_seqs 4 on each of 2 replicas), KV cache nearly empty: more replicas or more
    slots, never KV tuning; parallelism figures <= 4 x 2."""
    # few tokens, long first token: little client CPU per request, so a busy shared machine does not lag the loop
    sims = [simulator_factory(seed=10 + i, ttft_ms=200, itl_ms=5, jitter=0.05, max_num_seqs=4, output_len_min=8,
                              output_len_max=8) for i in range(2)]
    spec = spec_for([s.url for s in sims], sims[0].model, parallelism=32, verifier="exact")
    summary, d = await run_and_diagnose(sims[0], spec, 100)
    assert summary.completed == 100
    assert d.verdict == MODEL and d.subtype == "server_saturated", explain(d)
    ev_slots = {i.name: i.value for i in d.evidence_items}["server_slots"]
    assert ev_slots <= 8, ev_slots  # measured: running while others waited, over both replicas
    first = d.recommendations[0]
    assert first.setting == "max_num_seqs" and "replicas" in first.action, first
    assert all(p <= 4 * 2 for p in parallelism_figures(d)), d.recommendations
    assert parallelism_figures(d), "a parallelism figure bounded by the slots"
    text = " ".join(r.action for r in d.recommendations)
    assert "gpu_memory_utilization" not in text and "max_model_len from" not in text


@pytest.mark.slow
async def test_saturated_kv_cache_with_preemptions(simulator_factory):
    """A KV cache of 600 tokens (2 requests of max_model_len 300): preemptions; the server's own
    gpu_memory_utilization (0.9) and max_model_len (300) appear in the advice."""
    sim = simulator_factory(seed=11, ttft_ms=5, itl_ms=2, jitter=0.05, kv_cache_tokens=600, max_model_len=300)
    spec = spec_for([sim.url], sim.model, parallelism=16, verifier="exact",
                    responses_create_params={"max_output_tokens": 100})
    summary, d = await run_and_diagnose(sim, spec, 80)
    assert summary.completed == 80
    assert d.verdict == MODEL and d.subtype == "server_saturated", explain(d)
    held = {i.name: i.value for i in d.held()}
    assert held.get("vllm_preemptions", 0) >= 1 or held.get("kv_cache_usage_max", 0) >= 0.9
    first = d.recommendations[0]
    assert first.setting == "gpu_memory_utilization" and "from 0.9 to 0.95" in first.action, first
    mml = next(r for r in d.recommendations if r.setting == "max_model_len")
    assert "from 300" in mml.action and mml.value < 300
    slots = {i.name: i.value for i in d.evidence_items}["server_slots"]
    assert all(p <= slots for p in parallelism_figures(d))


@pytest.mark.slow
async def test_429_storm(simulator_factory):
    """30 % of requests answered 429: parallelism <= RPM/60 x the measured latency, within the server."""
    sim = simulator_factory(seed=12, ttft_ms=20, itl_ms=2, jitter=0.05, fault_rates={"429": 0.3}, retry_after_s=0)
    spec = spec_for([sim.url], sim.model, parallelism=16, verifier="exact")
    summary, d = await run_and_diagnose(sim, spec, 150)
    assert d.verdict == NETWORK, explain(d)
    assert "rate_429" in {i.name for i in d.held()}
    first = d.recommendations[0]
    assert first.setting == "num_samples_in_parallel" and "RPM/60 x mean latency" in first.action, first
    slots = {i.name: i.value for i in d.evidence_items}["server_slots"]
    assert 1 <= first.value <= slots


@pytest.mark.slow
async def test_rpm_window(simulator_factory):
    """A hosted API's 120 requests/minute: parallelism = floor(120/60 x measured latency)."""
    sim = simulator_factory(seed=13, ttft_ms=200, itl_ms=10, jitter=0.05, output_len_min=10, output_len_max=10,
                            rpm_limit=120, retry_after_s=1)
    spec = spec_for([sim.url], sim.model, parallelism=16, verifier="exact")
    summary, d = await run_and_diagnose(sim, spec, 160, config={"rpm_limit": 120})
    assert d.verdict == NETWORK, explain(d)
    first = d.recommendations[0]
    assert first.setting == "num_samples_in_parallel" and "120/60" in first.action, first
    latency = float(first.action.split(" x ")[-1].split(" s")[0])
    assert 0.25 <= latency <= 1.0  # the measured request latency (0.3 s + load), not a default
    assert first.value == rate_limit_parallelism(120, latency)


@pytest.mark.slow
async def test_dead_replica_is_named(simulator_factory):
    sim = simulator_factory(seed=14, ttft_ms=10, itl_ms=2, jitter=0.05)
    dead = dead_url()
    spec = spec_for([sim.url, dead], sim.model, parallelism=8, verifier="exact")
    summary, d = await run_and_diagnose(sim, spec, 100, config={"replicas": 2})
    assert d.verdict == NETWORK, explain(d)
    first = d.recommendations[0]
    assert first.setting == "replicas" and first.value == dead and dead in first.action, first


@pytest.mark.slow
async def test_hung_replica_is_named(simulator_factory):
    sims = [simulator_factory(seed=15, ttft_ms=50, itl_ms=5, jitter=0.05),
            simulator_factory(seed=16, ttft_ms=5, itl_ms=1, fault_rates={"stall": 1.0})]
    spec = spec_for([s.url for s in sims], sims[0].model, timeout_s=1.0, parallelism=8, verifier="exact")
    summary, d = await run_and_diagnose(sims[0], spec, 100, config={"replicas": 2})
    assert d.verdict == NETWORK, explain(d)
    first = d.recommendations[0]
    assert first.setting == "replicas" and first.value == sims[1].url, first


@pytest.mark.slow
async def test_outputs_at_the_token_limit(simulator_factory):
    """Every output stops at max_output_tokens (finish reason `length`): a truncation warning, never
    'reduce max_output_tokens'."""
    sim = simulator_factory(seed=17, ttft_ms=20, itl_ms=4, jitter=0.05, max_num_seqs=256)
    spec = spec_for([sim.url], sim.model, parallelism=4, verifier="exact",
                    responses_create_params={"max_output_tokens": 24})
    summary, d = await run_and_diagnose(sim, spec, 60, config={"max_output_tokens": 24})
    assert d.verdict == MODEL, explain(d)
    assert "truncated_outputs" in {c.name for c in d.conditions}
    trunc = [r for r in d.recommendations if "truncated" in r.action]
    assert trunc and "max_output_tokens 24" in trunc[0].action
    assert not any(r.action.startswith(("Reduce max_output_tokens", "Lower max_output_tokens")) for r in d.recommendations)
    first = d.recommendations[0]  # the server has room: raise parallelism, bounded by what it can hold
    slots = {i.name: i.value for i in d.evidence_items}["server_slots"]
    assert first.setting == "num_samples_in_parallel" and 4 < first.value <= slots and "Bound:" in first.why


@pytest.mark.slow
async def test_replica_out_of_rotation_is_named_without_server_metrics(simulator_factory):
    """A hosted endpoint (no /metrics) with one dead replica of two: the breaker takes it out after its first
    refusals, so it gets almost no attempts and error counts alone would not name it; the breaker's state does."""
    from workers.diagnosis import diagnose_ticks
    from workers.diagnosis.scenarios import rows_math, task_items
    from workers.engine.runner import run_collection
    from workers.telemetry import Telemetry, TelemetrySink

    sim = simulator_factory(seed=17, ttft_ms=10, itl_ms=2, jitter=0.05)
    dead = dead_url()
    spec = spec_for([dead, sim.url], sim.model, parallelism=8, verifier="exact")
    sink = TelemetrySink(None, Telemetry(metrics_urls=[], scrape_interval_s=0.5, sample_interval_s=0.25))
    summary = await run_collection(spec, task_items(rows_math(80)), sink)
    assert summary.completed == 80 and summary.failed == 0
    d = diagnose_ticks(list(sink.history), config={"parallelism": 8, "verifier": "exact", "replicas": 2})
    first = d.recommendations[0]
    assert first.setting == "replicas" and first.value == dead, first
    assert "out of rotation" in first.action and "cannot connect" in first.action, first
    assert "1 other replica" in first.why, first
    assert sum(r.setting == "replicas" and r.value == dead for r in d.recommendations) == 1  # named once
