"""Adaptive concurrency vs the best fixed parallelism found by a sweep, on three bottlenecks.

For each scenario (simulator + verifier configured to be bound by one thing):
  1. run the product's parallelism sweep (`workers.sweep.run_sweep`) -> curve, recommended setting;
  2. candidate fixed levels: the sweep's recommendation, half and double it, and its best level;
  3. timed runs of equal length (--seconds) of each fixed level and of adaptive concurrency (starting at
     --initial, an uninformed default), interleaved over --rounds rounds (order rotated) to spread the
     machine's drift; throughput = successful rollouts / run time (whole run, ramp included), and over the
     second half of the run ("steady");
  4. table: adaptive / best fixed.

Scenarios
  model      : simulator max_num_seqs=64, ~0.8 s per request (TTFT 150 ms + 32 x 20 ms), cheap verifier
  ratelimit  : simulator RPM limit (hosted-API mode, sliding 60 s window), ~0.3 s per request. Before every
               timed run the window is refilled evenly by a run paced at the limit (client-side RPM pacing)
               for 62 s, and each timed run lasts a whole window (60 s): every run starts from the same
               state and none inherits budget another left unused (~2 min per run)
  verify     : fast model (~20 ms), CPU-burning verifier (15 ms per row) in a pool of 1 process

    .venv/bin/python -m bench.bench_adaptive --rounds 1      # all three, ~25 minutes on 2 shared cores
    .venv/bin/python -m bench.bench_adaptive --scenarios model --seconds 20 --rounds 1
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.adaptive import AdaptiveConcurrency  # noqa: E402
from workers.diagnosis.scenarios import rows_math, use_scenario_verify_pool  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, ControlState, EndpointSpec, TaskItem  # noqa: E402
from workers.sweep import run_sweep  # noqa: E402
from workers.telemetry import Telemetry  # noqa: E402

SCENARIOS = {
    "model": dict(
        sim=dict(seed=0, ttft_ms=150, itl_ms=20, jitter=0.05, max_num_seqs=64, output_len_min=32, output_len_max=32),
        spec=dict(verifier="exact", responses_create_params={"max_output_tokens": 32}),
        sweep=dict(start=4, max_parallelism=512, waves=3, max_tasks_per_level=600),
        metrics=True,
    ),
    "ratelimit": dict(
        sim=dict(seed=0, ttft_ms=100, itl_ms=10, jitter=0.05, output_len_min=20, output_len_max=20, rpm_limit=1200,
                 retry_after_s=1),
        spec=dict(verifier="exact", responses_create_params={"max_output_tokens": 20}),
        sweep=dict(start=1, max_parallelism=128, waves=3, max_tasks_per_level=400),
        metrics=False,  # a hosted API: no /metrics
        fixed=[64, 16, 8, 4],
    ),
    "verify": dict(
        sim=dict(seed=0, ttft_ms=10, itl_ms=1, jitter=0.05, output_len_min=10, output_len_max=10),
        spec=dict(verifier="burn", verifier_options={"burn_ms": 15}, verify_processes=1),
        sweep=dict(start=1, max_parallelism=256, waves=3, max_tasks_per_level=400),
        metrics=False,
    ),
}


class Deadline:
    """Control: cancel the run after `seconds`."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def poll(self) -> ControlState:
        return ControlState(action="cancel") if time.monotonic() >= self.end else ControlState()


class Count:
    def __init__(self, inner=None):
        self.inner = inner
        self.finish: list[float] = []
        self.ok = 0

    async def rollout(self, r):
        if r.ok:
            self.ok += 1
            self.finish.append(time.monotonic())
        if self.inner is not None:
            await self.inner.rollout(r)

    async def progress(self, t):
        if self.inner is not None:
            await self.inner.progress(t)

    async def close(self):
        if self.inner is not None:
            await self.inner.close()


def endless(rows):
    for k in itertools.count():
        i = k % len(rows)
        yield TaskItem(task_index=i, rollout_index=k // len(rows), row=rows[i])


async def timed_run(spec: CollectionSpec, rows, seconds: float, parallelism: int | None, initial: int, metrics: bool):
    """One run of `seconds`: fixed parallelism, or adaptive (parallelism None)."""
    deadline = Deadline(seconds)
    ctl = telemetry = None
    if parallelism is None:
        telemetry = Telemetry(metrics_urls=spec.endpoint.base_urls, scrape_interval_s=2.0, gpu=False) if metrics else None
        ctl = AdaptiveConcurrency(initial=initial, telemetry=telemetry)
        sink = Count(ctl.wrap(None))
        if telemetry is not None:
            from workers.telemetry import TelemetrySink

            sink = TelemetrySink(sink, telemetry)
        control = ctl.control(deadline)
        spec = dataclasses.replace(spec, parallelism=initial)
    else:
        sink = Count()
        control = deadline
        spec = dataclasses.replace(spec, parallelism=parallelism)
    counter = sink if isinstance(sink, Count) else sink.inner
    t0 = time.monotonic()
    await run_collection(spec, endless(rows), sink, control)
    elapsed = time.monotonic() - t0
    half = t0 + elapsed / 2
    second_half = sum(1 for t in counter.finish if t >= half) / (elapsed / 2)
    return {"rps": counter.ok / elapsed, "steady_rps": second_half, "elapsed": elapsed,
            "final_limit": ctl.limit if ctl else parallelism,
            "decisions": ctl.decisions if ctl else None}


async def warm_rate_window(spec: CollectionSpec, rows, rpm: int, seconds: float = 62.0):
    """Fill the simulator's sliding 60 s RPM window evenly: a run paced at the limit by the client."""
    ep = dataclasses.replace(spec.endpoint, rpm_limit=rpm)
    paced = dataclasses.replace(spec, endpoint=ep, parallelism=64)
    await run_collection(paced, endless(rows), Count(), Deadline(seconds))


async def scenario(name: str, args) -> dict:
    cfg = SCENARIOS[name]
    if cfg["spec"].get("verifier") == "burn":
        use_scenario_verify_pool(cfg["spec"].get("verify_processes", 1))
    sim = start_simulator(**cfg["sim"])
    try:
        ep = EndpointSpec(base_urls=[sim.url], model=sim.model, max_retries=3, backoff_base_s=0.2, backoff_max_s=2.0,
                          request_timeout_s=60)
        spec = CollectionSpec(endpoint=ep, progress_interval_s=0.5, **cfg["spec"])
        rows = rows_math(256)
        out: dict = {"scenario": name}
        rate_limited = "rpm_limit" in cfg["sim"]
        if rate_limited:
            fixed = cfg["fixed"]
        else:
            print(f"[{name}] sweep ...", flush=True)
            sw = await run_sweep(spec, rows, **cfg["sweep"])
            out["sweep"] = {"curve": [(p.parallelism, p.rollouts_per_s, p.error_rate) for p in sw.points],
                            "recommended": sw.recommended, "hint": sw.hint, "stopped": sw.stopped_reason}
            print(f"[{name}] sweep curve {out['sweep']['curve']} -> recommended {sw.recommended} ({sw.hint})", flush=True)
            rec = sw.recommended
            fixed = sorted({max(1, rec // 2), rec, min(512, rec * 2), sw.best_parallelism})
        results: dict = {p: [] for p in fixed}
        results["adaptive"] = []
        for rnd in range(args.rounds):
            if rate_limited:
                order = ["adaptive"] + sorted(fixed, reverse=True)
            else:
                order = ["adaptive"] + list(fixed)
                k = rnd % len(order)
                order = order[k:] + order[:k]
            for what in order:
                seconds = args.seconds
                if rate_limited:
                    # every run starts from the same state: a window filled evenly at the limit, and lasts a
                    # whole window, so no run inherits budget another left unused
                    await warm_rate_window(spec, rows, cfg["sim"]["rpm_limit"])
                    seconds = max(60.0, args.seconds)
                r = await timed_run(spec, rows, seconds, None if what == "adaptive" else what, args.initial, cfg["metrics"])
                results[what].append(r)
                print(f"[{name}] round {rnd + 1} {what!s:>8}: {r['rps']:7.2f} rollouts/s (steady {r['steady_rps']:7.2f})"
                      + (f" final limit {r['final_limit']}" if what == "adaptive" else ""), flush=True)
        if rate_limited:
            print(f"[{name}] sweep (after the timed runs; reported, not used to pick levels) ...", flush=True)
            sw = await run_sweep(spec, rows, **cfg["sweep"])
            out["sweep"] = {"curve": [(p.parallelism, p.rollouts_per_s, p.error_rate) for p in sw.points],
                            "recommended": sw.recommended, "hint": sw.hint, "stopped": sw.stopped_reason}
            print(f"[{name}] sweep curve {out['sweep']['curve']} -> recommended {sw.recommended} ({sw.hint})", flush=True)

        def mean(xs):
            return sum(xs) / len(xs) if xs else 0.0

        table = {str(k): {"rps": mean([r["rps"] for r in v]), "steady_rps": mean([r["steady_rps"] for r in v])}
                 for k, v in results.items()}
        best_fixed = max((k for k in results if k != "adaptive"), key=lambda k: table[str(k)]["rps"])
        out["fixed"] = {str(k): table[str(k)] for k in fixed}
        out["adaptive"] = table["adaptive"]
        out["adaptive"]["final_limits"] = [r["final_limit"] for r in results["adaptive"]]
        out["adaptive"]["decisions_last_run"] = results["adaptive"][-1]["decisions"]
        out["best_fixed"] = {"parallelism": best_fixed, **table[str(best_fixed)]}
        best_steady = max(table[str(k)]["steady_rps"] for k in fixed)
        out["ratio"] = table["adaptive"]["rps"] / table[str(best_fixed)]["rps"]
        out["ratio_steady"] = table["adaptive"]["steady_rps"] / best_steady if best_steady else None
        return out
    finally:
        sim.stop()


async def main_async(args) -> list[dict]:
    outs = []
    for name in args.scenarios:
        outs.append(await scenario(name, args))
    print()
    print(f"{'scenario':<10} {'best fixed':>10} {'fixed r/s':>10} {'adaptive r/s':>13} {'ratio':>7} {'steady ratio':>13}  adaptive final limits")
    for o in outs:
        print(f"{o['scenario']:<10} {o['best_fixed']['parallelism']:>10} {o['best_fixed']['rps']:>10.2f} "
              f"{o['adaptive']['rps']:>13.2f} {o['ratio']:>7.2f} {o['ratio_steady'] or 0:>13.2f}  {o['adaptive']['final_limits']}")
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=["model", "ratelimit", "verify"], choices=list(SCENARIOS))
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each timed run")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (order rotated)")
    ap.add_argument("--initial", type=int, default=16, help="adaptive controller's starting parallelism")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    outs = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outs, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
