"""The classifier on hand-built evidence: one case per verdict, the recommendations' numbers, the seed-002
conditions, and evidence built from tick dicts."""
import pytest

from workers.diagnosis import (
    CONTROL_PLANE, INSUFFICIENT, MODEL, NETWORK, VERIFICATION, Evidence, build_evidence, diagnose,
    rate_limit_parallelism,
)
from workers.diagnosis import classifier as C


def base(**kw):
    ev = Evidence(n_rollouts=500, n_ok=500, throughput_rps=50.0, parallelism=32, in_flight_mean=31.5,
                  slot_utilization=0.98, cpu_cores=8, attempts=500, rate_429=0.0, rate_5xx=0.0, rate_timeout=0.0,
                  rate_connection=0.0, rate_4xx=0.0, loop_lag_p99_ms=3.0, loop_lag_mean_ms=1.0, cpu_main_pct=20.0)
    for k, v in kw.items():
        setattr(ev, k, v)
    return ev


def shares(ev, ttft, gen, verify, wall):
    ev.ttft_ms, ev.generation_ms, ev.verify_ms, ev.wall_ms = ttft, gen, verify, wall
    ev.model_share = (ttft + gen) / wall
    ev.verify_share = verify / wall
    ev.overhead_share = max(0.0, 1 - ev.model_share - ev.verify_share)
    return ev


def actions(d):
    return " | ".join(r.action for r in d.recommendations)


def test_model_bound_server_saturated():
    ev = shares(base(vllm_scrapes=10, vllm_waiting_frac=0.9, vllm_waiting_mean=40, vllm_running_max=64,
                     vllm_kv_max=0.93, max_num_seqs=64, gpu_util_mean=97.0, max_model_len=32768), 200, 2000, 5, 2230)
    d = diagnose(ev)
    assert d.verdict == MODEL and d.subtype == "server_saturated"
    assert d.confidence >= 0.7
    text = actions(d)
    assert "max_model_len" in text and "gpu_memory_utilization" in text and "0.95" in text
    assert "tensor_parallel_size" in text and "max_num_batched_tokens" not in text  # KV-bound: memory, not batching
    assert any(r.setting == "max_model_len" and r.value == 8192 for r in d.recommendations)
    names = {i.name: i for i in d.held()}
    assert {"model_share", "server_waiting_frac", "running_vs_max_num_seqs", "gpu_utilization"} <= set(names)
    # every evidence item carries its threshold
    assert all(i.threshold is not None for i in d.evidence_items if i.supports)


def test_model_bound_with_room_recommends_raising_parallelism():
    ev = shares(base(parallelism=8, vllm_scrapes=10, vllm_waiting_frac=0.0, vllm_running_max=8, vllm_kv_max=0.1,
                     max_num_seqs=256), 100, 900, 3, 1010)
    d = diagnose(ev)
    assert d.verdict == MODEL and d.subtype == "client_parallelism"
    first = d.recommendations[0]
    assert first.setting == "num_samples_in_parallel" and first.value == 16
    assert "Raise parallelism" in first.action


def test_verification_bound():
    ev = shares(base(cpu_children_pct=760.0), 20, 80, 400, 510)
    d = diagnose(ev)
    assert d.verdict == VERIFICATION
    text = actions(d)
    assert "lru_cache" in text and "fast" in text and "deferred" in text.lower()
    assert {"verify_share", "verify_pool_cpu"} <= {i.name for i in d.held()}


def test_rate_limited_with_known_rpm_computes_parallelism():
    ev = shares(base(rate_429=0.25, throughput_rps=8.2, rpm_limit=500), 300, 700, 2, 1010)
    d = diagnose(ev)
    assert d.verdict == NETWORK
    rec = d.recommendations[0]
    # 500 / 60 x 1.0 s = 8.33 -> 8 (the seed's example: 500 RPM tier -> parallelism <= 8)
    assert rec.value == 8 and "500/60" in rec.action
    assert rate_limit_parallelism(500, 1.0) == 8
    assert rate_limit_parallelism(600, 2.5) == 25


def test_rate_limited_without_known_rpm_estimates_it():
    ev = shares(base(rate_429=0.4, throughput_rps=10.0), 50, 250, 1, 305)
    d = diagnose(ev)
    assert d.verdict == NETWORK
    rec = d.recommendations[0]
    assert rec.value == rate_limit_parallelism(600, 0.3) == 3
    assert "estimated" in rec.why


def test_control_plane_bound():
    ev = shares(base(loop_lag_p99_ms=450.0, loop_lag_mean_ms=120.0, cpu_main_pct=98.0, slot_utilization=0.5), 300, 300, 2, 1400)
    d = diagnose(ev)
    assert d.verdict == CONTROL_PLANE
    assert "event loop" in actions(d)
    assert {"loop_lag_p99_ms", "loop_lag_mean_ms", "cpu_main_pct", "overhead_share"} <= {i.name for i in d.held()}


def test_insufficient_evidence():
    assert diagnose(Evidence(n_rollouts=5)).verdict == INSUFFICIENT
    # plenty of rollouts but nothing stands out
    ev = shares(base(), 100, 100, 100, 400)
    d = diagnose(ev)
    assert d.verdict == INSUFFICIENT and d.confidence == 0
    assert "sweep" in actions(d)


def test_sweep_scaling_is_evidence():
    ev = shares(base(), 100, 300, 5, 420)
    ev.sweep = {"points": [{"parallelism": 1, "rollouts_per_s": 2.0}, {"parallelism": 64, "rollouts_per_s": 120.0}],
                "recommended": 64}
    d = diagnose(ev)
    assert d.verdict == MODEL
    assert "sweep_speedup" in {i.name for i in d.held()}


def test_conditions_from_seed_002():
    ev = shares(base(vllm_scrapes=5, vllm_preemptions=12, vllm_kv_max=0.99, rate_timeout=0.05, request_timeout_s=60,
                     throughput_cv=0.6, gpu_util_mean=30.0, gpu_count=1, rate_5xx=0.05, cold_start_ratio=5.0), 100, 900, 3, 1010)
    d = diagnose(ev)
    names = {c.name: c for c in d.conditions}
    assert {"oom_preemption", "timeouts", "inconsistent_speeds", "low_gpu_utilization", "server_errors", "cold_start"} <= set(names)
    assert any("gpu_memory_utilization to 0.85-0.90" in f for f in names["oom_preemption"].fixes)
    assert any("client timeout" in f for f in names["timeouts"].fixes)
    assert any("thermal" in f for f in names["inconsistent_speeds"].fixes)
    assert any("Pre-warm" in f for f in names["low_gpu_utilization"].fixes)
    assert "60 s" in names["timeouts"].evidence


def test_to_dict_is_json_serializable():
    import json

    d = diagnose(shares(base(vllm_scrapes=3, vllm_waiting_frac=1.0), 100, 900, 1, 1010))
    out = json.loads(json.dumps(d.to_dict()))
    assert out["verdict"] == MODEL
    assert out["evidence_items"][0]["name"]
    assert {"action", "why"} <= set(out["recommendations"][0])


def _tick(elapsed, completed, in_flight=16, parallelism=16, errors=None, **tel):
    return {"elapsed_s": elapsed, "completed": completed, "failed": 0, "in_flight": in_flight, "parallelism": parallelism,
            "samples_per_s": 0, "errors": errors or {}, "extra": {"telemetry": tel}}


def test_build_evidence_from_ticks():
    timing = {"n": 50, "ok": 50, "ttft_ms": {"mean": 100}, "generation_ms": {"mean": 300}, "verify_ms": {"mean": 10},
              "wall_ms": {"mean": 420}, "queue_ms": {"mean": 5}}
    worker = {"cpu_main": 30.0, "cpu_children": 10.0, "cpu_total": 40.0, "cpu_cores": 4, "cpu_machine": 20.0,
              "loop_lag": {"mean_ms": 1.0, "p99_ms": 4.0, "n": 10}}
    vllm = {"ok": True, "running": 16, "waiting": 3, "kv_usage": 0.5, "preemptions_delta": 0, "queue": {"count": 40, "mean": 0.2}}
    ticks = [_tick(i + 1.0, 50 * (i + 1), timing=timing, worker=worker, vllm=vllm, errors={"http_429": 1} if i == 0 else None)
             for i in range(10)]
    # a second run (resume) in the same series: counters restart
    ticks += [_tick(1.0, 40, timing=timing, worker=worker), _tick(2.0, 80, timing=timing, worker=worker)]
    for t in ticks[-2:]:
        t["worker"] = "w2"
    ev = build_evidence(ticks, config={"parallelism": 16, "rpm_limit": 6000})
    assert ev.n_ok == 500 + 80
    assert ev.throughput_rps == pytest.approx(50 + 40, rel=0.01)
    assert ev.model_share == pytest.approx(400 / 420)
    assert ev.verify_share == pytest.approx(10 / 420)
    assert ev.vllm_waiting_frac == 1.0 and ev.vllm_queue_mean_s == pytest.approx(0.2)
    assert ev.rate_429 == pytest.approx(1 / 581)
    assert ev.cpu_cores == 4 and ev.loop_lag_p99_ms == 4.0
    assert ev.rpm_limit == 6000
    d = diagnose(ev)
    assert d.verdict == MODEL


def test_thresholds_are_named_constants():
    for name in ("VERIFY_SHARE_BOUND", "MODEL_SHARE_BOUND", "RATE_429", "LOOP_LAG_P99_MS", "KV_HIGH", "GPU_BUSY_PCT",
                 "SERVER_WAITING_FRAC", "THROUGHPUT_CV"):
        assert isinstance(getattr(C, name), (int, float))


def test_slow_verifier_on_the_event_loop_is_verification_not_control_plane():
    ev = shares(base(loop_lag_p99_ms=600.0, loop_lag_mean_ms=200.0, cpu_main_pct=99.0), 20, 80, 600, 720)
    d = diagnose(ev)
    assert d.verdict == VERIFICATION
    assert "process pool" in d.recommendations[0].action


def _series(name, start, n, in_flight, parallelism):
    """n one-second ticks of one chunk run, starting at wall-clock second `start`."""
    return [dict(_tick(float(i + 1), 10 * (i + 1), in_flight=in_flight, parallelism=parallelism),
                 worker=name, t=float(start + i)) for i in range(n)]


def test_concurrent_series_add_up_to_the_job_parallelism():
    # two chunks of one job on one worker at the same time, each with half of the job's 24
    ticks = _series("w chunk 0", 1000, 10, 12, 12) + _series("w chunk 1", 1000, 10, 12, 12)
    ev = build_evidence(ticks, config={"parallelism": 24})
    assert ev.parallelism == pytest.approx(24)
    assert ev.in_flight_mean == pytest.approx(24)


def test_sequential_series_do_not_add_up():
    # the same two chunks one after the other: the job never had more than 12 in flight
    ticks = _series("w chunk 0", 1000, 10, 12, 12) + _series("w chunk 1", 1010, 10, 12, 12)
    ev = build_evidence(ticks, config={"parallelism": 12})
    assert ev.parallelism == pytest.approx(12)
    assert ev.in_flight_mean == pytest.approx(12)


def test_slots_left_empty_while_rollouts_wait_on_the_verifier_count_for_verification():
    """A rollout being verified holds no request slot, so a verifier that cannot keep up leaves slots empty: that
    is verification's evidence, not the control plane's. Without a verification share it stays the control
    plane's (the engine did not keep its slots full)."""
    ev = shares(base(slot_utilization=0.45, in_flight_mean=14.4), 100, 200, 90, 400)  # verify_share 0.225
    d = diagnose(ev)
    item = next(i for i in d.evidence_items if i.name == "slot_utilization_low")
    assert item.holds and item.supports == VERIFICATION and "wait on the verifier" in item.meaning
    ev = shares(base(slot_utilization=0.45, in_flight_mean=14.4), 100, 200, 2, 400)
    item = next(i for i in diagnose(ev).evidence_items if i.name == "slot_utilization_low")
    assert item.holds and item.supports == CONTROL_PLANE


def test_series_whose_ticks_drift_across_seconds_still_add_up():
    """On a loaded worker a run ticks every 1.3 s, not every second: its ticks skip whole seconds. Three chunks at a
    third of 8 each still make 8 in every second they all ran, not fewer in the seconds one of them skipped."""
    ticks = []
    for k, offset in enumerate((0.0, 0.45, 0.9)):
        ticks += [dict(_tick(1.3 * (i + 1), 10 * (i + 1), in_flight=8 / 3, parallelism=8 / 3),
                       worker=f"w chunk {k}", t=1000.0 + offset + 1.3 * (i + 1)) for i in range(12)]
    ev = build_evidence(ticks, config={"parallelism": 8})
    # only the first and last second of the stretch miss a chunk that had not yet started or had stopped
    assert 7.3 < ev.parallelism <= 8.0 + 1e-9, ev.parallelism
    assert ev.in_flight_mean == pytest.approx(ev.parallelism)
