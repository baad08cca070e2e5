#!/usr/bin/env python3
"""Routing over endpoint replicas: least outstanding only (the routing before) vs affinity + circuit breaker (now).

    .venv/bin/python -m bench.bench_replicas [--json PATH]

Runs the engine (workers.engine.runner.run_collection, no database) against simulator processes it starts, in
three scenarios, each with both routings side by side in one run:

* dead    one replica of two has nothing listening (30 tasks x 4 repeats, parallelism 16, the endpoint's default
          retry budget: 5 retries, backoff 0.5 s x 2^n): failed rollouts and the share of attempts sent to it;
* hang    one replica of two hangs (accepts connections, never answers) after 100 rollouts (200 tasks x 4,
          request timeout 3 s): failed rollouts, attempts caught on it, wall time;
* prefix  two healthy replicas whose prefill costs 100 ms per 1,000 uncached prompt tokens (600-token prompts,
          100 tasks x 4 repeats): the servers' prefix-cache hit rate (vllm:prefix_cache_hits / _queries) and
          rollouts/s.

"least outstanding only" is the routing as it was: each attempt to the replica with the fewest requests in
flight, no affinity, no rotation (a failing replica stays in), retries wherever that rule says after the
backoff. It is emulated here by a ReplicaSet subclass swapped into the runner, never shipped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.simulator_process import start_simulator_process  # noqa: E402

import workers.engine.runner as runner  # noqa: E402
from workers.engine.materialize import materialize  # noqa: E402
from workers.engine.replicas import ReplicaSet  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402

MODEL = "sim-model"
FILLER = ("Answer the arithmetic question below. Show the steps, keep every intermediate result, and finish with "
          "the final answer in a box. ")


class LeastOutstandingOnly(ReplicaSet):
    """The routing before: fewest in flight, ties round-robin; nothing leaves rotation; no probes."""

    def pick(self, key=None, exclude=frozenset()):
        self.rr = (self.rr + 1) % self.n
        return min(range(self.n), key=lambda i: (self.replicas[i].in_flight, (i - self.rr) % self.n))

    def in_rotation(self, exclude=frozenset()):
        return 0  # no immediate switch to another replica: retries wait for the backoff, as before

    def failed(self, idx, message, replica_fault, unreachable=False):
        self.replicas[idx].errors += 1

    async def probe_loop(self):
        return


class Sink:
    def __init__(self, on_result=None):
        self.results, self.ticks, self.on_result = [], [], on_result

    async def rollout(self, r):
        self.results.append(r)
        if self.on_result:
            self.on_result(len(self.results))

    async def progress(self, t):
        self.ticks.append(t)

    async def close(self):
        pass


def start_sim(*args) -> tuple[subprocess.Popen, str]:
    return start_simulator_process("--model", MODEL, *args)


def http(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def metric(url, name) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in http("GET", url + "/metrics").splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{") or line.startswith(name + "_total"))


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def rows(n, long_prompt=False):
    out = []
    for i in range(n):
        a, b = 10 + i, 7 * i + 3
        # the task's own words first: only the repeats of one task share a prompt prefix
        text = f"Task {i}: what is {a} + {b}? " + (FILLER * 24 if long_prompt else "")
        out.append((i, {"responses_create_params": {"input": [{"role": "user", "content": text}]}, "expected_answer": str(a + b)}))
    return out


def run(policy, urls, n_tasks, repeats, on_result=None, long_prompt=False, **ep):
    runner.ReplicaSet = LeastOutstandingOnly if policy == "before" else ReplicaSet
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=urls, model=MODEL, **ep), parallelism=16, verifier="none",
                          progress_interval_s=0.5, responses_create_params={"max_output_tokens": 16})
    sink = Sink(on_result)
    t0 = time.monotonic()
    summary = asyncio.run(runner.run_collection(spec, materialize(rows(n_tasks, long_prompt), repeats), sink))
    wall = time.monotonic() - t0
    reps = {r["url"]: r for r in sink.ticks[-1].extra["replicas"]}
    return summary, wall, reps, sink


def scenario_dead(out):
    proc, live = start_sim("--ttft-ms", 30, "--itl-ms", 1, "--seed", 1)
    dead = dead_url()
    try:
        for policy in ("before", "now"):
            s, wall, reps, _ = run(policy, [dead, live], 30, 4)
            attempts = sum(r["requests"] for r in reps.values())
            out.append({"scenario": "dead", "routing": policy, "rollouts": s.completed + s.failed, "failed": s.failed,
                        "attempts": attempts, "to_faulty": reps[dead]["requests"],
                        "faulty_share": reps[dead]["requests"] / attempts, "wall_s": wall,
                        "rollouts_per_s": (s.completed + s.failed) / wall})
    finally:
        proc.kill()


def scenario_hang(out):
    for policy in ("before", "now"):
        procs = [start_sim("--ttft-ms", 30, "--itl-ms", 1, "--seed", 2 + k) for k in range(2)]
        a, b = procs[0][1], procs[1][1]
        fired = []

        def on_result(n):
            if n == 100 and not fired:  # noqa: B023
                fired.append(1)  # noqa: B023
                threading.Thread(target=http, args=("POST", b + "/admin/config", {"hang": True}), daemon=True).start()  # noqa: B023
        try:
            s, wall, reps, _ = run(policy, [a, b], 200, 4, on_result=on_result, request_timeout_s=3.0,
                                   backoff_base_s=0.2, backoff_max_s=2.0)
            attempts = sum(r["requests"] for r in reps.values())
            out.append({"scenario": "hang", "routing": policy, "rollouts": s.completed + s.failed, "failed": s.failed,
                        "attempts": attempts, "to_faulty": reps[b]["requests"] - reps[b]["ok"],
                        "faulty_share": (reps[b]["requests"] - reps[b]["ok"]) / attempts, "wall_s": wall,
                        "rollouts_per_s": (s.completed + s.failed) / wall})
        finally:
            for p, _ in procs:
                p.kill()


def scenario_prefix(out):
    procs = [start_sim("--ttft-ms", 20, "--itl-ms", 1, "--prefill-ms-per-1k", 100, "--seed", 5 + k) for k in range(2)]
    urls = [u for _, u in procs]
    try:
        for policy in ("before", "now"):
            for u in urls:
                http("POST", u + "/reset_prefix_cache")
            q0 = sum(metric(u, "vllm:prefix_cache_queries") for u in urls)
            h0 = sum(metric(u, "vllm:prefix_cache_hits") for u in urls)
            s, wall, reps, _ = run(policy, urls, 100, 4, long_prompt=True)
            q = sum(metric(u, "vllm:prefix_cache_queries") for u in urls) - q0
            h = sum(metric(u, "vllm:prefix_cache_hits") for u in urls) - h0
            out.append({"scenario": "prefix", "routing": policy, "rollouts": s.completed + s.failed, "failed": s.failed,
                        "attempts": sum(r["requests"] for r in reps.values()), "prefix_hit_rate": h / q if q else 0.0,
                        "wall_s": wall, "rollouts_per_s": (s.completed + s.failed) / wall})
    finally:
        for p, _ in procs:
            p.kill()


def table(rows_):
    head = f"{'scenario':<8} {'routing':<26} {'rollouts':>8} {'failed':>6} {'attempts':>8} {'to faulty':>9} {'share':>6} {'prefix hit':>10} {'wall s':>7} {'rollouts/s':>10}"
    lines = [head, "-" * len(head)]
    names = {"before": "least outstanding only", "now": "affinity + breaker (now)"}
    for r in rows_:
        share = f"{r['faulty_share']:.0%}" if "faulty_share" in r else "-"
        hit = f"{r['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in r else "-"
        lines.append(f"{r['scenario']:<8} {names[r['routing']]:<26} {r['rollouts']:>8} {r['failed']:>6} {r['attempts']:>8} "
                     f"{r.get('to_faulty', '-'):>9} {share:>6} {hit:>10} {r['wall_s']:>7.1f} {r['rollouts_per_s']:>10.1f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", choices=["dead", "hang", "prefix"], action="append")
    args = ap.parse_args()
    out: list[dict] = []
    for name, fn in (("dead", scenario_dead), ("hang", scenario_hang), ("prefix", scenario_prefix)):
        if not args.only or name in args.only:
            fn(out)
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
