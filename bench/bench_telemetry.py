"""What telemetry costs: throughput with and without `TelemetrySink`, interleaved runs.

Each round runs the same collection twice against a zero-latency simulator at high parallelism (so the
worker's own CPU is the limit and any overhead shows): once with a plain counting sink, once with that
sink wrapped in `TelemetrySink` (host CPU / RSS / GPU every 2 s, loop lag every 0.1 s, vLLM /metrics every
5 s, the interval's timing summary on every tick). The order alternates every round. Reported: median
throughput of each, the median of the per-round ratios, and the direct cost measured by timing the
telemetry code itself (per-rollout bookkeeping + per-tick payload), as a share of the run's wall time --
the noise-free bound on the overhead.

    .venv/bin/python -m bench.bench_telemetry                  # 8 rounds x 2 runs of 1500 rollouts
    .venv/bin/python -m bench.bench_telemetry --rounds 4 -n 1000 -c 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math, task_items  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402
from workers.telemetry import Telemetry, TelemetrySink  # noqa: E402


class Count:
    def __init__(self):
        self.ok = 0

    async def rollout(self, r):
        self.ok += r.ok

    async def progress(self, t):
        pass

    async def close(self):
        pass


class TimedTelemetrySink(TelemetrySink):
    """TelemetrySink that measures the time spent in its own code (not in the inner sink)."""

    spent = 0.0

    async def rollout(self, result):
        t = time.perf_counter()
        if not self.telemetry.started:
            self.telemetry.start()
        self.timing.add(result)
        self.spent += time.perf_counter() - t
        await self.inner.rollout(result)

    async def progress(self, tick):
        t = time.perf_counter()
        payload = self.telemetry.payload()
        payload["timing"] = self.timing.collect()
        tick.extra["telemetry"] = payload
        from workers.telemetry.collector import tick_to_dict

        self.history.append(tick_to_dict(tick))
        self.spent += time.perf_counter() - t
        await self.inner.progress(tick)


async def one(spec, n, with_telemetry: bool) -> dict:
    count = Count()
    sink = count
    tel = None
    if with_telemetry:
        tel = Telemetry(metrics_urls=spec.endpoint.base_urls)
        sink = TimedTelemetrySink(count, tel)
    t0 = time.monotonic()
    await run_collection(spec, task_items(rows_math(n)), sink)
    elapsed = time.monotonic() - t0
    out = {"rps": count.ok / elapsed, "elapsed": elapsed, "ok": count.ok}
    if with_telemetry:
        out["spent_s"] = sink.spent
        out["ticks"] = len(sink.history)
    return out


async def main_async(args):
    sim = start_simulator(seed=0, ttft_ms=0, itl_ms=0, jitter=0, output_len_min=16, output_len_max=16)
    try:
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=args.c,
                              verifier="exact", progress_interval_s=1.0)
        await one(spec, 300, False)  # warm up both sides
        rows = []
        for rnd in range(args.rounds):
            order = [False, True] if rnd % 2 == 0 else [True, False]
            res = {}
            for w in order:
                res[w] = await one(spec, args.n, w)
            ratio = res[True]["rps"] / res[False]["rps"]
            direct = res[True]["spent_s"] / res[True]["elapsed"]
            rows.append({"without": res[False]["rps"], "with": res[True]["rps"], "ratio": ratio, "direct": direct})
            print(f"round {rnd + 1}: without {res[False]['rps']:8.1f}/s  with {res[True]['rps']:8.1f}/s  ratio {ratio:5.3f}  "
                  f"telemetry code {1000 * res[True]['spent_s']:.1f} ms = {100 * direct:.2f}% of the run", flush=True)
    finally:
        sim.stop()
    med = statistics.median
    summary = {
        "rounds": len(rows), "n": args.n, "parallelism": args.c,
        "without_rps_median": med(r["without"] for r in rows),
        "with_rps_median": med(r["with"] for r in rows),
        "ratio_median": med(r["ratio"] for r in rows),
        "overhead_median_pct": 100 * (1 - med(r["ratio"] for r in rows)),
        "direct_cost_pct_median": 100 * med(r["direct"] for r in rows),
        "rows": rows,
    }
    print()
    print(f"{'':<24}{'rollouts/s':>12}")
    print(f"{'without telemetry':<24}{summary['without_rps_median']:>12.1f}")
    print(f"{'with telemetry':<24}{summary['with_rps_median']:>12.1f}")
    print(f"median per-round ratio  {summary['ratio_median']:.3f}  (overhead {summary['overhead_median_pct']:+.2f}%)")
    print(f"direct cost of the telemetry code: {summary['direct_cost_pct_median']:.3f}% of run time (median)")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("-n", type=int, default=1500, help="rollouts per run")
    ap.add_argument("-c", type=int, default=64, help="parallelism")
    ap.add_argument("--json")
    args = ap.parse_args()
    summary = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
