"""Verification throughput, side by side (one run, one machine):

1. pool vs loop: a CPU-heavy verifier (a busy loop of --burn-ms per row, then exact match) in a collection
   run of the engine against the zero-latency simulator: run in the engine's process pool (kind cpu)
   vs called on the event loop (the verifier not marked CPU-bound). Both named by dotted path, as a
   user's own verifier would be. rollouts/s = successful rollouts / run time.
2. cache on vs off: code execution in the sandbox (bubblewrap + rlimits) over stored rollouts of a
   dataset with repeats (--tasks tasks x --repeats repeats; each rollout is one of 3 programs of its
   task: right, wrong, crashing, as a policy that has mostly converged produces), verified the way the
   batch verification job does (VerifyExecutor, --concurrency sandboxes at once), with the result cache
   per job vs off. rollouts/s = rollouts / wall time; rewards must be equal.
3. cache per chunk vs job-wide: the same rollouts shuffled into --chunks chunks (a task's repeats land in
   different chunks), taken by 2 workers at once, each chunk run with a fresh executor as a chunk task is:
   a cache local to each chunk run vs the job-wide shared cache (Redis at $REDIS_URL). Sandbox runs =
   verifications actually computed.

    .venv/bin/python -m bench.bench_verifiers                 # ~2 minutes on 2 shared cores
    .venv/bin/python -m bench.bench_verifiers --rollouts 200 --tasks 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import CountingSink  # noqa: E402
from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.verify_pool import shutdown_verify_pool  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec, TaskItem  # noqa: E402
from workers.verifiers import sandbox  # noqa: E402
from workers.verifiers.execution import VerifyExecutor  # noqa: E402


async def collection(sim, verifier: str, n: int, parallelism: int, burn_ms: float, processes: int) -> dict:
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=parallelism,
                          verifier=verifier, verifier_options={"burn_ms": burn_ms}, verify_processes=processes,
                          responses_create_params={"max_output_tokens": 8}, verify_cache="off")
    rows = rows_math(n)
    sink = CountingSink(rewards=True)
    t0 = time.monotonic()
    summary = await run_collection(spec, [TaskItem(i, 0, r) for i, r in enumerate(rows)], sink)
    wall = time.monotonic() - t0
    assert not summary.fatal_error, summary.fatal_error
    return {"ok": sink.ok, "failed": sink.failed, "wall_s": wall, "rps": sink.ok / wall,
            "mean_reward": sum(sink.rewards) / max(1, len(sink.rewards))}


PROGRAMS = [
    ("a, b = map(int, input().split())\nprint(a + b + {k} - {k})", 1.0),
    ("a, b = map(int, input().split())\nprint(a - b + {k} - {k})", 0.0),
    ("raise SystemExit('crash {k}')", 0.0),
]


def code_rollouts(tasks: int, repeats: int, seed=0):
    rng = random.Random(seed)
    out = []
    for t in range(tasks):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        row = {"verifier_metadata": {"unit_tests": {"inputs": [f"{a} {b}\n", f"{b} {a}\n"],
                                                    "outputs": [f"{a + b}\n", f"{a + b}\n"]}}, "task": t}
        for _ in range(repeats):
            prog, want = PROGRAMS[rng.choices((0, 1, 2), weights=(6, 3, 1))[0]]
            out.append((row, f"```python\n{prog.format(k=t)}\n```", want))
    return out


async def code_run(items, cache: str, concurrency: int) -> dict:
    ex = VerifyExecutor("code", {"wall_s": 5, "cpu_s": 2}, cache=cache, concurrency=concurrency)
    t0 = time.monotonic()
    try:
        results = await asyncio.gather(*(ex.verify(row, text) for row, text, _ in items))
    finally:
        await ex.aclose()
    wall = time.monotonic() - t0
    rewards = [r.reward for r in results]
    assert rewards == [w for _, _, w in items], "a program was scored wrong"
    return {"wall_s": wall, "rps": len(items) / wall, "hit_rate": ex.hits / ex.lookups if ex.lookups else 0.0,
            "rewards": rewards}


async def chunked_run(items, shared_url: str | None, chunks: int, concurrency: int, scope: str) -> dict:
    order = list(range(len(items)))
    random.Random(1).shuffle(order)
    size = -(-len(order) // chunks)
    parts = [order[i:i + size] for i in range(0, len(order), size)]
    results: dict[int, float] = {}
    counts = {"lookups": 0, "hits": 0}

    async def worker(mine):
        for part in mine:  # one chunk task after another, each with its own executor
            ex = VerifyExecutor("code", {"wall_s": 5, "cpu_s": 2}, cache="job", concurrency=concurrency,
                                shared_url=shared_url, shared_scope=scope)
            try:
                out = await asyncio.gather(*(ex.verify(items[i][0], items[i][1]) for i in part))
            finally:
                await ex.aclose()
            assert not ex.shared_error, ex.shared_error
            for i, r in zip(part, out):
                results[i] = r.reward
            counts["lookups"] += ex.lookups
            counts["hits"] += ex.hits

    t0 = time.monotonic()
    await asyncio.gather(worker(parts[0::2]), worker(parts[1::2]))
    wall = time.monotonic() - t0
    assert [results[i] for i in range(len(items))] == [w for _, _, w in items], "a program was scored wrong"
    return {"wall_s": wall, "rps": len(items) / wall, "computed": counts["lookups"] - counts["hits"],
            "hit_rate": counts["hits"] / counts["lookups"]}


async def main_async(args) -> dict:
    out = {}
    sim = start_simulator(seed=0, ttft_ms=0, itl_ms=0, jitter=0, math_accuracy=0.8)
    try:
        pool_name = "workers.diagnosis.scenarios:BurnVerifier"
        loop_name = "workers.diagnosis.scenarios:InlineBurnVerifier"
        await collection(sim, pool_name, 64, args.parallelism, args.burn_ms, args.processes)  # warm both paths
        await collection(sim, loop_name, 32, args.parallelism, args.burn_ms, args.processes)
        pool = await collection(sim, pool_name, args.rollouts, args.parallelism, args.burn_ms, args.processes)
        loop = await collection(sim, loop_name, args.rollouts, args.parallelism, args.burn_ms, args.processes)
        out["cpu"] = {"pool": pool, "loop": loop}
    finally:
        sim.stop()
        shutdown_verify_pool()
    items = code_rollouts(args.tasks, args.repeats)
    await code_run(items[:16], "off", args.concurrency)  # warm
    off = await code_run(items, "off", args.concurrency)
    on = await code_run(items, "job", args.concurrency)
    assert off["rewards"] == on["rewards"]
    out["code"] = {"off": off, "job": on, "n": len(items), "sandbox": sandbox.mode()[0]}
    import uuid

    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    per_chunk = await chunked_run(items, None, args.chunks, args.concurrency // 2, "")
    shared = await chunked_run(items, url, args.chunks, args.concurrency // 2, f"bench:{uuid.uuid4().hex}")
    out["chunks"] = {"per_chunk": per_chunk, "shared": shared, "distinct": len({(r["task"], t) for r, t, _ in items})}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=400, help="collection run length (CPU-heavy verifier)")
    ap.add_argument("--burn-ms", type=float, default=20.0, help="CPU burned per row by the verifier")
    ap.add_argument("--parallelism", type=int, default=32)
    ap.add_argument("--processes", type=int, default=2, help="the engine's verification pool size")
    ap.add_argument("--tasks", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16, help="sandboxes at once")
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the job-wide cache comparison")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    cpu, code = res["cpu"], res["code"]
    print(f"\n1. CPU-heavy verifier ({args.burn_ms:g} ms CPU per row), collection of {args.rollouts} rollouts, "
          f"parallelism {args.parallelism}, zero-latency simulator, {os.cpu_count()} cores")
    print(f"{'':26} {'process pool (' + str(args.processes) + ')':>20} {'on the event loop':>20} {'pool / loop':>12}")
    print(f"{'rollouts/s':26} {cpu['pool']['rps']:>20.1f} {cpu['loop']['rps']:>20.1f} "
          f"{cpu['pool']['rps'] / cpu['loop']['rps']:>11.2f}x")
    print(f"{'wall s':26} {cpu['pool']['wall_s']:>20.1f} {cpu['loop']['wall_s']:>20.1f}")
    print(f"{'mean reward':26} {cpu['pool']['mean_reward']:>20.3f} {cpu['loop']['mean_reward']:>20.3f}")
    print(f"\n2. Code execution ({code['sandbox']}), {code['n']} stored rollouts = {args.tasks} tasks x {args.repeats} "
          f"repeats, 2 tests each, {args.concurrency} sandboxes at once")
    print(f"{'':26} {'cache per job':>20} {'cache off':>20} {'on / off':>12}")
    print(f"{'rollouts/s':26} {code['job']['rps']:>20.1f} {code['off']['rps']:>20.1f} "
          f"{code['job']['rps'] / code['off']['rps']:>11.2f}x")
    print(f"{'wall s':26} {code['job']['wall_s']:>20.1f} {code['off']['wall_s']:>20.1f}")
    print(f"{'cache hit rate':26} {code['job']['hit_rate']:>20.0%} {'-':>20}")
    print("rewards equal with and without the cache: yes")
    ch = res["chunks"]
    print(f"\n3. The same {code['n']} rollouts in {args.chunks} chunks (repeats spread over chunks), 2 workers at once, "
          f"{args.concurrency // 2} sandboxes each; {ch['distinct']} distinct (task, program)")
    print(f"{'':26} {'job-wide (Redis)':>20} {'per chunk run':>20} {'shared / per':>12}")
    print(f"{'rollouts/s':26} {ch['shared']['rps']:>20.1f} {ch['per_chunk']['rps']:>20.1f} "
          f"{ch['shared']['rps'] / ch['per_chunk']['rps']:>11.2f}x")
    print(f"{'sandbox runs':26} {ch['shared']['computed']:>20} {ch['per_chunk']['computed']:>20}")
    print(f"{'cache hit rate':26} {ch['shared']['hit_rate']:>20.0%} {ch['per_chunk']['hit_rate']:>20.0%}")
    if args.json:
        for k in ("off", "job"):
            code[k].pop("rewards")
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
