"""What profiling costs: a verification-bound collection on the simulator with profiling off, on for
verification only (wall clock, the default: sampled within a 2 % budget), and on for the whole worker
(every thread of the engine process and every verification), interleaved rounds in one run.

The simulator answers at once (no latency) and the math verifier runs in a pool of `--processes` processes,
so verification is the limit and any profiling cost shows in the throughput. Each round runs the three
modes in a rotating order. Reported: median throughput of each, the median of the per-round ratios to "off",
and, for verification-only, the cost the profiler itself measured (profiled vs unprofiled verifications
timed in the pool processes, weighted by the sampled share), which does not move with other processes' load
on a shared machine the way the A/B ratio does. CPU ms per rollout (the engine process and the verifier
processes, from psutil) is the other load-independent figure: when verification is the limit, its ratio to
"off" is the throughput a dedicated machine would lose.

    .venv/bin/python -m bench.bench_profiling                     # 4 rounds x 3 runs of 1200 rollouts
    .venv/bin/python -m bench.bench_profiling --rounds 6 -n 2000 --processes 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math, task_items  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402
from workers.engine.verify_pool import SHARED_VERIFY_POOL  # noqa: E402
from workers.profiling.control import ProfilingControl, ProfilingSink  # noqa: E402
from workers.profiling.core import ProfileConfig, merge_rows  # noqa: E402

MODES = ("off", "verify", "worker")


class Count:
    def __init__(self):
        self.ok = 0

    async def rollout(self, r):
        self.ok += r.ok

    async def progress(self, t):
        pass

    async def close(self):
        pass


def cpu_seconds() -> float:
    """CPU time of this process (every thread: the engine) and of the verifier processes."""
    total = sum(psutil.Process().cpu_times()[:2])
    ex = SHARED_VERIFY_POOL._executor
    for proc in (getattr(ex, "_processes", None) or {}).values():
        try:
            total += sum(psutil.Process(proc.pid).cpu_times()[:2])
        except psutil.Error:
            pass
    return total


async def one(spec, n, mode, k) -> dict:
    count = Count()
    sink, control, snaps = count, None, []
    if mode != "off":
        cfg = ProfileConfig(session=f"bench-{mode}-{k}", scope=mode, clock="wall", budget_pct=2.0, window_s=5.0)
        control = ProfilingControl(None, lambda: cfg, snaps.extend, worker="bench",
                                   pool=lambda: SHARED_VERIFY_POOL._executor)
        sink = ProfilingSink(count, control)
    t0, c0 = time.monotonic(), cpu_seconds()
    await run_collection(spec, task_items(rows_math(n)), sink, control)
    elapsed, cpu = time.monotonic() - t0, cpu_seconds() - c0
    out = {"rps": count.ok / elapsed, "ok": count.ok, "elapsed": elapsed, "cpu_ms_per_rollout": 1000 * cpu / max(1, count.ok)}
    if snaps:
        items = sum(s.verifications for s in snaps)
        over = [(s.verifications, s.overhead_pct) for s in snaps if s.overhead_pct is not None]
        rows = merge_rows({}, [r for s in snaps for r in s.rows])
        top = max((r for r in rows.values() if r.name == "MathVerifier.verify"), key=lambda r: r.ttot, default=None)
        out.update(snapshots=len(snaps), verifications=items, profiled=sum(s.profiled for s in snaps),
                   measured_overhead_pct=(sum(v * o for v, o in over) / max(1, sum(v for v, _ in over))) if over else None,
                   verify_ncall=round(top.ncall) if top else None)
    return out


async def main_async(args):
    sim = start_simulator(seed=0, ttft_ms=0, itl_ms=0, jitter=0, output_len_min=16, output_len_max=16)
    try:
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=args.c,
                              verifier="math", verify_processes=args.processes, progress_interval_s=1.0)
        await one(spec, 300, "off", 0)  # warm up: the pool's processes, sympy, connections
        await one(spec, 300, "verify", 0)
        results = {m: [] for m in MODES}
        for rnd in range(args.rounds):
            order = MODES[rnd % 3:] + MODES[:rnd % 3]
            res = {}
            for m in order:
                res[m] = await one(spec, args.n, m, rnd + 1)
                results[m].append(res[m])
            print(f"round {rnd + 1}: " + "  ".join(f"{m} {res[m]['rps']:7.1f}/s" for m in MODES)
                  + f"  (verify: {res['verify'].get('profiled')} of {res['verify'].get('verifications')} profiled, "
                    f"measured {res['verify'].get('measured_overhead_pct') or 0:.2f}%)", flush=True)
    finally:
        sim.stop()
    med = statistics.median
    off = [r["rps"] for r in results["off"]]
    summary = {"rounds": args.rounds, "n": args.n, "parallelism": args.c, "processes": args.processes, "modes": {}}
    off_cpu = [r["cpu_ms_per_rollout"] for r in results["off"]]
    for m in MODES:
        ratios = [r["rps"] / o for r, o in zip(results[m], off)]
        cpu_ratios = [r["cpu_ms_per_rollout"] / o for r, o in zip(results[m], off_cpu)]
        summary["modes"][m] = {"rps_median": med(r["rps"] for r in results[m]), "ratio_median": med(ratios),
                               "cost_pct": 100 * (1 - med(ratios)),
                               "cpu_ms_per_rollout_median": med(r["cpu_ms_per_rollout"] for r in results[m]),
                               "cpu_ratio_median": med(cpu_ratios), "cpu_cost_pct": 100 * (med(cpu_ratios) - 1),
                               "runs": results[m]}
    v = results["verify"]
    summary["verify_measured_overhead_pct"] = med(r["measured_overhead_pct"] or 0.0 for r in v)
    summary["verify_profiled_share_pct"] = 100 * sum(r["profiled"] for r in v) / max(1, sum(r["verifications"] for r in v))
    print()
    print(f"verification-bound collection: simulator (no latency), math verifier in {args.processes} processes, "
          f"parallelism {args.c}, {args.n} rollouts per run, {args.rounds} rounds (median)")
    print(f"{'profiling':<38}{'rollouts/s':>11}{'vs off':>8}{'cost':>8}{'CPU ms/rollout':>16}{'vs off':>8}{'cost':>8}")
    labels = {"off": "off", "verify": "verification only (wall, 2% budget)", "worker": "whole worker (wall)"}
    for m in MODES:
        s = summary["modes"][m]
        print(f"{labels[m]:<38}{s['rps_median']:>11.1f}{s['ratio_median']:>8.3f}{s['cost_pct']:>7.2f}%"
              f"{s['cpu_ms_per_rollout_median']:>16.2f}{s['cpu_ratio_median']:>8.3f}{s['cpu_cost_pct']:>7.2f}%")
    print(f"verification only: {summary['verify_profiled_share_pct']:.2f}% of verifications profiled; cost the "
          f"profiler measured in the pool: {summary['verify_measured_overhead_pct']:.2f}% (median of rounds)")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-n", type=int, default=1200, help="rollouts per run")
    ap.add_argument("-c", type=int, default=64, help="parallelism")
    ap.add_argument("--processes", type=int, default=2, help="verifier processes")
    ap.add_argument("--json")
    args = ap.parse_args()
    summary = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
