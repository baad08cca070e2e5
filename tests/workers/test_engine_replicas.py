"""Several replicas behind one endpoint, with real simulator processes: least outstanding + task affinity,
a dead replica taken out of rotation (no rollout lost), a replica that dies mid-run and comes back (it gets
traffic again), a replica that hangs (cut by timeouts and probes; the run finishes on the other)."""
from __future__ import annotations

import asyncio
import socket
import time
import pytest
from collections import Counter, defaultdict

from tests.fixtures_simulator import start_simulator
from workers.engine.materialize import materialize
from workers.engine.replicas import ReplicaSet
from workers.engine.runner import run_collection

from .test_engine import ListSink, math_rows, spec_for


def dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


def served(sim) -> int:
    """Requests the simulator answered, by its own /metrics."""
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in sim.metrics_text().splitlines()
                   if line.startswith("vllm:request_success_total")))


def last_replicas(sink) -> dict:
    return {r["url"]: r for r in sink.ticks[-1].extra["replicas"]}


def assert_exactly_once(sink, n_tasks, n_repeats):
    pairs = [(r.task_index, r.rollout_index) for r in sink.results]
    assert len(pairs) == len(set(pairs)) == n_tasks * n_repeats
    assert set(pairs) == {(t, k) for t in range(n_tasks) for k in range(n_repeats)}


@pytest.mark.slow
async def test_one_dead_replica_of_two_fails_no_rollout(simulator_factory):
    live = simulator_factory(ttft_ms=5, itl_ms=1, jitter=0, seed=1)
    dead = dead_url()
    sink = ListSink()
    spec = spec_for(live, base_urls=[dead, live.url], parallelism=16, verifier="none", max_retries=3)
    summary = await run_collection(spec, materialize(math_rows(30), 4), sink)
    assert summary.completed == 120 and summary.failed == 0 and not summary.fatal_error
    assert_exactly_once(sink, 30, 4)
    reps = last_replicas(sink)
    assert reps[dead]["state"] == "out" and "cannot connect" in reps[dead]["reason"]
    assert reps[dead]["ok"] == 0 and reps[live.url]["ok"] == 120 == served(live)
    attempts = reps[dead]["requests"] + reps[live.url]["requests"]
    # the dead replica is out after its first refused connections: the attempts it got are the ones in flight
    # when the first refusal came back (at most the parallelism), never a share of the run
    assert reps[dead]["requests"] <= 16 and reps[dead]["requests"] / attempts <= 0.12, reps
    assert all(r.replica == live.url for r in sink.results)


@pytest.mark.slow
async def test_repeats_of_a_task_land_on_one_replica_and_both_share_the_load(simulator_factory):
    a = simulator_factory(ttft_ms=5, itl_ms=1, jitter=0, seed=2)
    b = simulator_factory(ttft_ms=5, itl_ms=1, jitter=0, seed=3)
    sink = ListSink()
    spec = spec_for(a, base_urls=[a.url, b.url], parallelism=8, verifier="none")
    summary = await run_collection(spec, materialize(math_rows(60), 4), sink)
    assert summary.completed == 240 and summary.failed == 0
    assert_exactly_once(sink, 60, 4)
    homes = defaultdict(set)
    for r in sink.results:
        homes[r.task_index].add(r.replica)
    assert all(len(h) == 1 for h in homes.values()), {t: h for t, h in homes.items() if len(h) > 1}
    per_replica = Counter(next(iter(h)) for h in homes.values())
    assert per_replica[a.url] >= 15 and per_replica[b.url] >= 15, per_replica  # 60 tasks hashed over two
    assert served(a) == 4 * per_replica[a.url] and served(b) == 4 * per_replica[b.url]

    # without affinity the same tasks are spread by least outstanding alone: repeats split over both
    sink = ListSink()
    spec = spec_for(a, base_urls=[a.url, b.url], parallelism=8, verifier="none", replica_affinity=False)
    assert (await run_collection(spec, materialize(math_rows(60), 4), sink)).completed == 240
    split = defaultdict(set)
    for r in sink.results:
        split[r.task_index].add(r.replica)
    assert sum(len(h) > 1 for h in split.values()) >= 30


def test_least_outstanding_and_affinity_fall_back_when_home_is_overloaded():
    rs = ReplicaSet(["http://a", "http://b"], affinity=True)
    home = rs.pick(7)
    assert all(rs.pick(7) == home for _ in range(10))  # stable
    other = 1 - home
    for _ in range(20):  # the home replica holds many requests (slow or hung): the task goes elsewhere
        rs.begin(home)
    assert rs.pick(7) == other
    rs2 = ReplicaSet(["http://a", "http://b"], affinity=False)
    rs2.begin(0)
    assert rs2.pick(7) == 1 and rs2.pick(8) == 1  # least outstanding
    rs2.failed(1, "boom", replica_fault=True, unreachable=True)
    assert rs2.snapshot()[1]["state"] == "out" and rs2.pick(8) == 0  # out of rotation: not picked
    rs2.failed(0, "HTTP 500", replica_fault=True)
    rs2.failed(0, "HTTP 500", replica_fault=True)
    assert rs2.snapshot()[0]["state"] == "in"
    rs2.failed(0, "HTTP 500", replica_fault=True)  # third fault in a row
    assert rs2.snapshot()[0]["state"] == "out"
    assert rs2.pick(8) in (0, 1)  # every replica out: still a replica, never a hang
    rs2.succeeded(0)
    assert rs2.snapshot()[0]["state"] == "in"


async def _run_with_fault(spec, n_tasks, n_repeats, when, fault):
    """Run the engine; once `when` rollouts are in, call `fault()` in a thread (kill, restart, reconfigure)."""
    sink = ListSink()
    fired = asyncio.Event()

    class FaultSink(ListSink):
        async def rollout(self, result):
            sink.results.append(result)
            if len(sink.results) == when and not fired.is_set():
                fired.set()
                asyncio.get_running_loop().run_in_executor(None, fault)

        async def progress(self, tick):
            sink.ticks.append(tick)

    summary = await run_collection(spec, materialize(math_rows(n_tasks), n_repeats), FaultSink())
    return summary, sink


@pytest.mark.slow
async def test_replica_that_dies_and_comes_back_returns_to_rotation(simulator_factory):
    a = simulator_factory(ttft_ms=40, itl_ms=1, jitter=0, seed=4)
    b = simulator_factory(ttft_ms=40, itl_ms=1, jitter=0, seed=5)
    port = b.port
    state = {}

    def kill_then_restart():
        b.proc.kill()
        b.proc.wait(5)
        state["killed_at"] = time.time()
        time.sleep(2.0)
        state["b2"] = start_simulator("--port", str(port), ttft_ms=40, itl_ms=1, jitter=0, seed=6)
        state["back_at"] = time.time()

    spec = spec_for(a, base_urls=[a.url, b.url], parallelism=8, verifier="none", max_retries=3,
                    probe_max_s=0.5, health_interval_s=0.5, request_timeout_s=5)
    try:
        summary, sink = await _run_with_fault(spec, 300, 4, 100, kill_then_restart)
        b2 = state["b2"]
        assert summary.completed == 1200 and summary.failed == 0 and not summary.fatal_error
        assert_exactly_once(sink, 300, 4)
        reps = last_replicas(sink)
        assert reps[b.url]["times_out"] >= 1  # taken out when it died
        assert reps[b.url]["state"] == "in" and reps[b.url]["since"] >= state["back_at"] - 0.5  # put back
        served_again = served(b2)  # the new process counts only what it answered after coming back
        assert served_again >= 100, served_again
        assert served(a) == reps[a.url]["ok"] and served(a) + reps[b.url]["ok"] == 1200
        print(f"\nb before death + after return: {reps[b.url]['ok'] - served_again} + {served_again}; a {served(a)}")
    finally:
        if "b2" in state:
            state["b2"].stop()


@pytest.mark.slow
async def test_replica_that_hangs_is_cut_and_the_run_finishes_on_the_other(simulator_factory):
    a = simulator_factory(ttft_ms=20, itl_ms=1, jitter=0, seed=7)
    b = simulator_factory(ttft_ms=20, itl_ms=1, jitter=0, seed=8)
    # a request timeout far above the test's length: only the probe can cut what is caught on the hung replica
    spec = spec_for(a, base_urls=[a.url, b.url], parallelism=8, verifier="none", max_retries=3,
                    request_timeout_s=60.0, health_interval_s=0.5, probe_timeout_s=0.5, probe_max_s=1.0)
    t0 = time.monotonic()
    summary, sink = await _run_with_fault(spec, 150, 4, 60, lambda: b.configure(hang=True))
    elapsed = time.monotonic() - t0
    assert summary.completed == 600 and summary.failed == 0 and not summary.fatal_error
    assert_exactly_once(sink, 150, 4)
    reps = last_replicas(sink)
    assert reps[b.url]["state"] == "out" and reps[b.url]["times_out"] == 1
    assert "did not answer" in reps[b.url]["reason"], reps[b.url]
    assert reps[b.url]["cut"] >= 1  # the attempts caught on it were cut by the probe, not left to the timeout
    retried = [r for r in sink.results if r.attempts > 1]
    assert len(retried) == reps[b.url]["cut"] and all(r.replica == a.url for r in retried)
    after = sum(1 for r in sink.results[60:] if r.replica == b.url)
    assert after <= 8, after  # at most what was already on its way to b when it hung
    assert elapsed < 20, elapsed

    b.configure(hang=False)  # it recovers: the next run uses it again
    sink = ListSink()
    assert (await run_collection(spec, materialize(math_rows(40), 2), sink)).completed == 80
    assert {r.replica for r in sink.results} == {a.url, b.url}


@pytest.mark.slow
async def test_a_hung_replica_is_cut_by_the_request_timeout_without_probes(simulator_factory):
    """With probes slower than the request timeout, the timeouts themselves take the replica out (3 in a row)."""
    a = simulator_factory(ttft_ms=20, itl_ms=1, jitter=0, seed=9)
    b = simulator_factory(ttft_ms=20, itl_ms=1, jitter=0, seed=10)
    spec = spec_for(a, base_urls=[a.url, b.url], parallelism=8, verifier="none", max_retries=3,
                    request_timeout_s=1.5, health_interval_s=60.0)
    summary, sink = await _run_with_fault(spec, 100, 4, 60, lambda: b.configure(hang=True))
    assert summary.completed == 400 and summary.failed == 0
    assert_exactly_once(sink, 100, 4)
    reps = last_replicas(sink)
    assert reps[b.url]["state"] == "out" and "failed attempts in a row" in reps[b.url]["reason"], reps[b.url]
    assert reps[b.url]["cut"] == 0 and all(r.replica == a.url for r in sink.results if r.attempts > 1)


def test_a_replica_taken_out_stays_out_for_the_next_runs_of_the_worker_until_a_probe_answers():
    """Replica health is the worker process's, not the run's: a new run (a new chunk) starts with the replica the
    worker knows to be out still out, and sends it nothing until it is put back."""
    from workers.engine import replicas as rmod

    rmod.forget_shared_health()
    try:
        urls = ["http://shared-a:1", "http://shared-b:1"]
        first = ReplicaSet(urls, affinity=False, fail_threshold=2)
        first.failed(1, "connection refused", replica_fault=True, unreachable=True)
        assert not first.replicas[1].in_rotation
        second = ReplicaSet(urls, affinity=False)  # the next chunk run in this process
        assert not second.replicas[1].in_rotation and second.replicas[0].in_rotation
        assert "earlier run of this worker" in second.replicas[1].reason
        assert {second.pick(key=k) for k in range(20)} == {0}  # no request goes to it
        assert second.replicas[1].next_probe <= time.monotonic()  # probed as the run starts
        second._put_back(second.replicas[1], "health probe answered")  # what a probe answering 200 does
        third = ReplicaSet(urls, affinity=False)
        assert third.replicas[1].in_rotation and rmod.known_out() == {}
        assert ReplicaSet(["http://shared-b:1"]).replicas[0].in_rotation  # one replica: nothing to route around
    finally:
        rmod.forget_shared_health()


@pytest.mark.slow
async def test_a_single_url_run_reports_its_replica_table(simulator_factory):
    # the endpoint page's replica table and its health come from these ticks: a single URL is a replica too
    live = simulator_factory(ttft_ms=5, itl_ms=1, jitter=0, seed=1)
    sink = ListSink()
    spec = spec_for(live, parallelism=8, verifier="none")
    summary = await run_collection(spec, materialize(math_rows(20), 2), sink)
    assert summary.completed == 40
    reps = last_replicas(sink)
    assert list(reps) == [live.url] and reps[live.url]["ok"] == 40 and reps[live.url]["state"] == "in"
