"""Adaptive concurrency: the controller's logic against small closed-loop models of a server (capacity,
rate limit), then a real run on the simulator through the engine's Control and Sink protocols."""
import random
import pytest


from workers.adaptive import AdaptiveConcurrency
from workers.diagnosis.scenarios import rows_math, task_items
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, ControlState, EndpointSpec, ProgressTick, RolloutResult


class Plant:
    """A closed-loop model: L requests in flight against a server of `capacity` sequences with service time
    `service_s`; optional rate limit (accepted requests/s); multiplicative noise."""

    def __init__(self, capacity=64, service_s=0.5, rate_limit=None, noise=0.05, seed=0):
        self.capacity, self.service_s, self.rate_limit, self.noise = capacity, service_s, rate_limit, noise
        self.rng = random.Random(seed)
        self.t = 0.0
        self.completed = 0.0

    def step(self, ctl, dt=0.5):
        L = ctl.limit
        latency = self.service_s * max(1.0, L / self.capacity)
        demand = L / latency
        errors = {}
        if self.rate_limit is not None and demand > self.rate_limit:
            errors["http_429"] = int((demand - self.rate_limit) * dt)
            rate = self.rate_limit
        else:
            rate = demand
        rate *= 1 + self.rng.uniform(-self.noise, self.noise)
        n = int(rate * dt)
        for _ in range(n):
            ctl.observe_rollout(RolloutResult(0, 0, True, {}, wall_ms=latency * 1000, ttft_ms=latency * 1000 * 0.2,
                                              generation_ms=latency * 1000 * 0.8))
        self.completed += n
        self.t += dt
        tick = ProgressTick(elapsed_s=self.t, completed=int(self.completed), failed=0, in_flight=L, parallelism=L,
                            samples_per_s=rate, output_tokens_per_s=0, errors=errors)
        ctl.observe_tick(tick)
        return rate


def test_slow_start_finds_capacity_and_stays_near_it():
    ctl = AdaptiveConcurrency(initial=4, max_parallelism=1024)
    plant = Plant(capacity=64, service_s=0.5)
    rates = [plant.step(ctl) for _ in range(240)]
    best = 64 / 0.5
    assert sum(rates[-100:]) / 100 >= 0.9 * best
    assert 64 <= ctl.limit <= 160
    assert ctl.phase == "steady"
    # every change carries its reason
    assert ctl.decisions and all(d["reason"] for d in ctl.decisions)
    assert ctl.decisions[0]["from"] == 4 and "slow start" in ctl.decisions[0]["reason"]


def test_rate_limit_backs_off_to_littles_law():
    # 20 accepted requests/s, 0.5 s latency: about 10 in flight sustain the limit
    ctl = AdaptiveConcurrency(initial=64)
    plant = Plant(capacity=1000, service_s=0.5, rate_limit=20.0)
    rates = [plant.step(ctl) for _ in range(200)]
    reasons = [d["reason"] for d in ctl.decisions]
    assert any("429" in r and "RPM/60 x latency" in r for r in reasons)
    first_429 = next(d for d in ctl.decisions if d.get("signal") == "http_429")
    assert first_429["to"] <= 14  # 20/s x 0.5 s x 1.2 + 1
    assert 8 <= ctl.limit <= 16
    assert sum(rates[-100:]) / 100 >= 0.9 * 20.0


def test_latency_guard_gives_back_queueing_concurrency():
    ctl = AdaptiveConcurrency(initial=8, max_parallelism=2048)
    ctl.phase = "steady"
    plant = Plant(capacity=16, service_s=0.2)
    for _ in range(10):
        plant.step(ctl)
    ctl.limit = 512  # an operator (or a stale setting) put it far too high
    ctl._changed_at = plant.t
    for _ in range(200):  # 100 s: every cut waits for the queue to drain and two windows to agree
        plant.step(ctl)
    assert ctl.limit <= 64
    assert any(d.get("signal") == "latency" or "probe down" in d["reason"] for d in ctl.decisions)


def test_control_merges_inner_pause_and_cancel():
    class Inner:
        state = ControlState()

        def poll(self):
            return self.state

    ctl = AdaptiveConcurrency(initial=12)
    inner = Inner()
    control = ctl.control(inner)
    assert control.poll() == ControlState(action="run", parallelism=12)
    inner.state = ControlState(action="cancel")
    assert control.poll().action == "cancel"
    assert ctl.poll().parallelism == 12


@pytest.mark.slow
async def test_adaptive_run_on_simulator_climbs_and_records_decisions(simulator_factory):
    sim = simulator_factory(seed=0, ttft_ms=60, itl_ms=8, jitter=0.05, max_num_seqs=32, output_len_min=30, output_len_max=30)
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model, max_retries=1), parallelism=4,
                          verifier="exact", responses_create_params={"max_output_tokens": 30}, progress_interval_s=0.25)
    ctl = AdaptiveConcurrency(initial=4, max_parallelism=512)

    class Keep:
        def __init__(self):
            self.ticks = []

        async def rollout(self, r):
            pass

        async def progress(self, t):
            self.ticks.append(t)

        async def close(self):
            pass

    keep = Keep()
    summary = await run_collection(spec, task_items(rows_math(700)), ctl.wrap(keep), control=ctl.control())
    assert summary.completed == 700
    assert max(t.parallelism for t in keep.ticks) >= 32
    assert ctl.limit >= 16, ctl.decisions
    new = [d for t in keep.ticks for d in t.extra["adaptive"]["new_decisions"]]
    assert len(new) == len(ctl.decisions) and new[0]["from"] == 4
    assert all({"t", "from", "to", "reason"} <= set(d) for d in new)
    assert keep.ticks[-1].extra["adaptive"]["limit"] == ctl.limit


def test_operator_change_through_inner_control_is_adopted():
    class Inner:
        def __init__(self):
            self.state = ControlState()

        def poll(self):
            return self.state

    ctl = AdaptiveConcurrency(initial=8)
    inner = Inner()
    control = ctl.control(inner)
    inner.state = ControlState(action="run", parallelism=40)
    assert control.poll().parallelism == 40
    assert ctl.limit == 40 and "operator" in ctl.decisions[-1]["reason"]
    inner.state = ControlState(action="run")  # no further change: the controller keeps steering
    assert control.poll().parallelism == 40
