"""A diagnosis never advises against its own evidence: per scenario, no next step (nor a condition's fix)
contradicts the verdict or the server capacity the diagnosis prints, and an unreachable endpoint gets a
verdict of its own (not "not enough evidence, run a sweep")."""
import pytest

from workers.diagnosis import CONTROL_PLANE, INSUFFICIENT, MODEL, NETWORK, VERIFICATION, Evidence, build_evidence, diagnose
from workers.diagnosis.classifier import raises_parallelism

from tests.workers.test_diagnosis import base, shares

LOWERS = ("do not raise parallelism", "lower parallelism", "keep parallelism", "reduce parallelism",
          "already fills", "do not change parallelism", "set parallelism <=")


def _texts(d):
    return [r.action for r in d.recommendations] + [f for c in d.conditions for f in c.fixes] + [d.summary]


def _check(d, ev):
    """The invariant, for any diagnosis."""
    texts = _texts(d)
    raise_ = [t for t in texts if raises_parallelism(t)]
    lower = [t for t in texts if any(w in t.lower() for w in LOWERS)]
    assert not (raise_ and lower), f"contradiction: {raise_} vs {lower}"
    if raise_:
        # more parallelism only where the verdict is the model with room, within the printed capacity
        assert d.verdict == MODEL and d.subtype not in ("server_saturated", "server_full"), raise_
        par = int(round(ev.parallelism))
        assert not (d.server_slots and par >= d.server_slots), (raise_, d.server_slots)
        for r in d.recommendations:
            if r.setting == "num_samples_in_parallel" and r.value and raises_parallelism(r.action):
                assert r.value > par and (not d.server_slots or r.value <= d.server_slots)
    if d.verdict == INSUFFICIENT:
        assert d.confidence == 0


SCENARIOS = {
    "model_saturated": lambda: shares(base(vllm_scrapes=10, vllm_waiting_frac=0.9, vllm_waiting_mean=40, vllm_running_max=64,
                                           vllm_kv_max=0.93, max_num_seqs=64, gpu_util_mean=97.0, max_model_len=32768),
                                      200, 2000, 5, 2230),
    "model_room": lambda: shares(base(parallelism=8, vllm_scrapes=10, vllm_waiting_frac=0.0, vllm_running_max=8,
                                      vllm_kv_max=0.1, max_num_seqs=256), 100, 900, 3, 1010),
    # the case: parallelism 32 on a server that runs 32 at once, no queue seen
    "model_full": lambda: shares(base(parallelism=32, vllm_scrapes=10, vllm_waiting_frac=0.0, vllm_kv_max=0.2,
                                      server_slots=32, server_slots_bound="max_num_seqs 32", gpu_util_mean=30.0),
                                 100, 900, 3, 1010),
    "verification_low_gpu": lambda: shares(base(cpu_children_pct=760.0, gpu_util_mean=20.0), 20, 80, 400, 510),
    "rate_limited": lambda: shares(base(rate_429=0.25, throughput_rps=8.2, rpm_limit=500), 300, 700, 2, 1010),
    "control_plane_low_gpu": lambda: shares(base(loop_lag_p99_ms=450.0, loop_lag_mean_ms=120.0, cpu_main_pct=98.0,
                                                 slot_utilization=0.5, gpu_util_mean=10.0), 300, 300, 2, 1400),
    "agent": lambda: base(agent_job=True, agent_share=0.8, agent_run_ms=1000.0, agent_own_ms=800.0,
                          agent_model_ms=200.0, agent_model_calls=1.0, gpu_util_mean=10.0),
    "insufficient": lambda: shares(base(), 100, 100, 100, 400),
    "too_few": lambda: Evidence(n_rollouts=5),
    "unreachable": lambda: Evidence(n_rollouts=3, n_failed=3, attempts=18, rate_connection=1.0, rate_timeout=0.0,
                                    parallelism=32, error_counts={"connection": 18}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_next_step_contradicts_the_verdict_or_capacity(name):
    ev = SCENARIOS[name]()
    d = diagnose(ev)
    _check(d, ev)


def test_a_full_server_is_not_told_to_raise_parallelism():
    ev = SCENARIOS["model_full"]()
    d = diagnose(ev)
    assert d.verdict == MODEL and d.subtype == "server_full" and d.server_slots == 32
    assert "already fills the server" in d.summary and "raise parallelism" not in d.summary.lower().replace(
        "add replicas or raise max_num_seqs", "")
    assert any("replicas" in r.action for r in d.recommendations)


def test_verification_bound_keeps_no_increase_parallelism_fix():
    d = diagnose(SCENARIOS["verification_low_gpu"]())
    assert d.verdict == VERIFICATION
    gpu = [c for c in d.conditions if c.name == "low_gpu_utilization"]
    assert gpu and not any(raises_parallelism(f) for f in gpu[0].fixes)


def test_dead_endpoint_verdict():
    # a job on a dead endpoint: every attempt refused, a few rows failed, then the job failed
    ev = SCENARIOS["unreachable"]()
    d = diagnose(ev)
    assert d.verdict == NETWORK and d.subtype == "unreachable" and d.confidence >= 0.9
    assert d.summary.startswith("The endpoint is unreachable")
    text = " | ".join(r.action for r in d.recommendations)
    assert "Start the model server" in text and "sweep" not in text.lower()
    assert "endpoint_unreachable" in {i.name for i in d.held()}


def test_dead_endpoint_verdict_from_the_failure_alone():
    # the job failed before a single tick: only its reason tells
    ev = build_evidence([], config={"parallelism": 8, "failure_reason":
                                    "cannot reach http://127.0.0.1:9/v1: connection refused after 5 retries"})
    d = diagnose(ev)
    assert d.verdict == NETWORK and d.subtype == "unreachable"
    _check(d, ev)


def test_control_plane_scenario_stays_control_plane():
    d = diagnose(SCENARIOS["control_plane_low_gpu"]())
    assert d.verdict == CONTROL_PLANE
