"""Parallelism sweep: the curve analysis on its own, and a real sweep on the simulator with capacity 64."""
import pytest

from workers.diagnosis.scenarios import rows_math
from workers.engine.types import CollectionSpec, EndpointSpec
from workers.sweep import SweepPoint, analyze, default_levels, level_rate, middle_rate, run_sweep


def pt(p, rps, err=0.0, errors=None):
    return SweepPoint(parallelism=p, n=4 * p, completed=4 * p, failed=0, elapsed_s=1.0, rollouts_per_s=rps, p50_ms=100,
                      p99_ms=200, error_rate=err, errors=errors or {}, time_per_100_s=100 / rps if rps else None)


def test_levels():
    assert default_levels(1, 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert default_levels(4, 100) == [4, 8, 16, 32, 64, 100]


def test_model_bound_curve_knee_and_words():
    r = analyze([pt(1, 5), pt(2, 10), pt(4, 20), pt(8, 39), pt(16, 75), pt(32, 140), pt(64, 250), pt(128, 262), pt(256, 259)])
    assert r.knee == 64 and r.recommended == 64
    assert r.hint == "model"
    assert "Time fell a lot" in r.interpretation and "model was the bottleneck" in r.interpretation
    assert r.speedup == pytest.approx(262 / 5, rel=1e-3)


def test_flat_curve_means_verification_or_network():
    r = analyze([pt(1, 30), pt(2, 33), pt(4, 34), pt(8, 33)])
    assert r.hint == "verification_or_network"
    assert "Time similar" in r.interpretation
    assert r.recommended in (1, 2)


def test_errors_mean_overloaded_and_recommend_below():
    r = analyze([pt(1, 2), pt(2, 4), pt(4, 8), pt(8, 9, err=0.3, errors={"http_429": 40})])
    assert r.hint == "overloaded"
    assert r.recommended == 4
    assert "overloaded" in r.interpretation and "reduce parallelism" in r.interpretation
    assert "http_429" in r.interpretation


def test_middle_rate_leaves_out_ramp_and_tail():
    # 100 completions: 10 during a slow ramp, 80 at 100/s, 10 in a slow tail
    t = [i * 0.1 for i in range(10)] + [1.0 + i * 0.01 for i in range(80)] + [1.8 + i * 0.1 for i in range(10)]
    assert middle_rate(t, 0.0) == pytest.approx(100, rel=0.05)


@pytest.mark.slow
async def test_sweep_on_simulator_capacity_64_recommends_within_one_step(simulator_factory):
    # 64 sequences at once, ~0.8 s per request: the curve rises until 64 in flight, then requests only queue
    sim = simulator_factory(seed=0, ttft_ms=160, itl_ms=20, jitter=0.05, max_num_seqs=64, output_len_min=32, output_len_max=32)
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model, max_retries=1), verifier="exact",
                          responses_create_params={"max_output_tokens": 32}, progress_interval_s=0.5)
    seen = []
    result = await run_sweep(spec, rows_math(64), start=8, max_parallelism=512, waves=3, max_tasks_per_level=384,
                             on_point=seen.append)
    curve = [(p.parallelism, p.rollouts_per_s) for p in result.points]
    print("sweep curve", curve, "recommended", result.recommended, result.stopped_reason)
    assert [p.parallelism for p in seen] == [p for p, _ in curve]
    assert 32 <= result.recommended <= 128, (result.recommended, curve)
    assert result.hint == "model", result.interpretation
    assert "stopped rising" in result.stopped_reason, (result.stopped_reason, curve)
    assert result.points[-1].parallelism <= 512
    by_p = dict(curve)
    assert by_p[32] > 1.5 * by_p[8]  # still scaling below capacity
    assert result.elapsed_s < 60
    d = result.to_dict()
    assert d["points"][0]["parallelism"] == 8 and "interpretation" in d


def test_queueing_in_verification_past_the_knee():
    pts = [pt(1, 16), pt(2, 37), pt(4, 40), pt(8, 39)]
    for p, v in zip(pts, (15, 20, 60, 140)):
        p.verify_ms, p.model_ms = v, 20
    r = analyze(pts)
    assert r.hint == "verification"
    assert "verification is the bottleneck" in r.interpretation


def test_level_rate_leaves_out_start_up():
    # parallelism 2, 4 waves of 0.5 s after a 3 s start-up: 2 rollouts per 0.5 s = 4/s, not 8 / 5 s
    finish = [3.5, 3.5, 4.0, 4.0, 4.5, 4.5, 5.0, 5.0]
    assert level_rate(finish, 0.0, 2, 8) == pytest.approx(4.0)
    assert level_rate([1.0], 0.0, 1, 1) == pytest.approx(1.0)  # one wave: start -> last completion


@pytest.mark.slow
async def test_sweep_doubles_from_one_to_two_on_a_server_with_room(simulator_factory):
    """A server with room (256 slots, flat latency): parallelism 2 collects twice as fast as 1, within
    10 %; the first point is not slowed by start-up."""
    sim = simulator_factory(seed=3, ttft_ms=60, itl_ms=5, jitter=0.02, max_num_seqs=256, output_len_min=20,
                            output_len_max=20)
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model, max_retries=1), verifier="exact",
                          progress_interval_s=0.5)
    result = await run_sweep(spec, rows_math(16), levels=[1, 2], waves=8, min_tasks=8)
    by_p = {p.parallelism: p.rollouts_per_s for p in result.points}
    ratio = by_p[2] / by_p[1]
    print("sweep 1 -> 2", by_p, "ratio", ratio)
    assert abs(ratio - 2.0) <= 0.2, by_p
