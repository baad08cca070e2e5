"""What telemetry costs: throughput with and without `TelemetrySink`, interleaved runs.

Each round runs the same collection twice against a zero-latency simulator at high parallelism (so the
worker's own CPU is the limit and any overhead shows): once with a plain counting sink, once with that
sink wrapped in `TelemetrySink` (host CPU / RSS / GPU every 2 s, loop lag every 0.1 s, vLLM /metrics every
5 s, the interval's timing summary on every tick). The order alternates every round. Reported: median
throughput of each, the median of the per-round ratios, and the direct cost measured by timing the
pieces of telemetry in isolation (per-rollout bookkeeping, the per-tick payload with a second's worth of
rollouts, a /metrics parse) in CPU time, combined at the measured rate and divided by the event loop's CPU
per second: when the worker is CPU-bound that is the throughput telemetry costs, and unlike the A/B ratio it
does not move with other processes' load. The loop thread's CPU per rollout with and without is reported too.

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

from bench._common import CountingSink, NullSink  # noqa: E402
from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math, task_items  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402
from workers.telemetry import Telemetry, TelemetrySink  # noqa: E402


CLOCK = time.thread_time  # CPU time of the event-loop thread: immune to being descheduled on a shared machine


async def micro_costs(sim_url: str, rps: float) -> dict:
    """CPU cost of each piece of telemetry on the event loop, measured in isolation (tight loops)."""
    from workers.engine.types import ProgressTick, RolloutResult
    from workers.telemetry import parse_metrics, window
    from workers.telemetry.vllm import VllmScraper

    r = RolloutResult(1, 0, True, {}, queue_ms=1.0, ttft_ms=5.0, generation_ms=20.0, verify_ms=1.0, wall_ms=27.0,
                      output_tokens=16)
    n = 200_000
    null = NullSink()
    sink = TelemetrySink(NullSink(), Telemetry(gpu=False))
    sink.telemetry.started = True  # no background tasks for the tight loop
    t = CLOCK()
    for _ in range(n):
        await null.rollout(r)
    base = CLOCK() - t
    t = CLOCK()
    for _ in range(n):
        await sink.rollout(r)
    per_rollout = (CLOCK() - t - base) / n
    # one tick's payload with a second's worth of rollouts in its window
    ticks = 200
    per_tick = 0.0
    for _ in range(ticks):
        for _ in range(int(rps)):
            sink.timing.add(r)
        tick = ProgressTick(1.0, 0, 0, 64, 64, rps, 0.0)
        t = CLOCK()
        await sink.progress(tick)
        per_tick += CLOCK() - t
    per_tick /= ticks
    # a /metrics scrape: parse + window (the fetch's own I/O is the kernel's)
    scraper = VllmScraper([sim_url])
    text_snap = await scraper.scrape()
    await scraper.close()
    import urllib.request

    text = urllib.request.urlopen(sim_url + "/metrics", timeout=5).read().decode()
    prev = parse_metrics(text, t=0)
    t = CLOCK()
    for i in range(50):
        window(prev, parse_metrics(text, t=i + 1))
    per_scrape = (CLOCK() - t) / 50
    return {"per_rollout_us": per_rollout * 1e6, "per_tick_us": per_tick * 1e6, "per_scrape_ms": per_scrape * 1e3,
            "scrape_ok": bool(text_snap.get("ok"))}


async def one(spec, n, with_telemetry: bool) -> dict:
    count = CountingSink()
    sink = count
    tel = None
    if with_telemetry:
        tel = Telemetry(metrics_urls=spec.endpoint.base_urls)
        sink = TelemetrySink(count, tel)
    t0 = time.monotonic()
    c0 = CLOCK()
    await run_collection(spec, task_items(rows_math(n)), sink)
    elapsed = time.monotonic() - t0
    cpu = CLOCK() - c0
    out = {"rps": count.ok / elapsed, "elapsed": elapsed, "ok": count.ok, "loop_cpu_s": cpu}
    if with_telemetry:
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
            cpu_ratio = (res[True]["loop_cpu_s"] / res[True]["ok"]) / (res[False]["loop_cpu_s"] / res[False]["ok"])
            rows.append({"without": res[False]["rps"], "with": res[True]["rps"], "ratio": ratio,
                         "loop_cpu_per_rollout_us": 1e6 * res[False]["loop_cpu_s"] / res[False]["ok"],
                         "cpu_ratio": cpu_ratio})
            print(f"round {rnd + 1}: without {res[False]['rps']:8.1f}/s  with {res[True]['rps']:8.1f}/s  ratio {ratio:5.3f}  "
                  f"loop CPU per rollout with/without {cpu_ratio:5.3f}", flush=True)
        rps = statistics.median(r["without"] for r in rows)
        micro = await micro_costs(sim.url, rps)
    finally:
        sim.stop()
    med = statistics.median
    summary = {
        "rounds": len(rows), "n": args.n, "parallelism": args.c,
        "without_rps_median": med(r["without"] for r in rows),
        "with_rps_median": med(r["with"] for r in rows),
        "ratio_median": med(r["ratio"] for r in rows),
        "overhead_median_pct": 100 * (1 - med(r["ratio"] for r in rows)),
        "loop_cpu_ratio_median": med(r["cpu_ratio"] for r in rows),
        "micro": micro,
        "rows": rows,
    }
    # the model: telemetry CPU per second of run / the loop's CPU per second of run, at the measured rate
    cpu_per_rollout = med(r["loop_cpu_per_rollout_us"] for r in rows) * 1e-6
    per_s = (micro["per_rollout_us"] * 1e-6 * rps + micro["per_tick_us"] * 1e-6 * 1.0
             + micro["per_scrape_ms"] * 1e-3 / 5.0 + 10 * 20e-6)
    summary["model_overhead_pct"] = 100 * per_s / (rps * cpu_per_rollout)
    print()
    print(f"{'':<24}{'rollouts/s':>12}")
    print(f"{'without telemetry':<24}{summary['without_rps_median']:>12.1f}")
    print(f"{'with telemetry':<24}{summary['with_rps_median']:>12.1f}")
    print(f"median per-round ratio  {summary['ratio_median']:.3f}  (overhead {summary['overhead_median_pct']:+.2f}%)")
    print(f"event-loop CPU per rollout, with / without telemetry (median of rounds): {summary['loop_cpu_ratio_median']:.3f}")
    m = micro
    print(f"isolated costs: {m['per_rollout_us']:.2f} us per rollout, {m['per_tick_us']:.0f} us per tick "
          f"(a second's {rps:.0f} rollouts summarized), {m['per_scrape_ms']:.2f} ms per /metrics parse (every 5 s)")
    print(f"=> telemetry CPU / event-loop CPU at {rps:.0f} rollouts/s: {summary['model_overhead_pct']:.2f}%")
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
