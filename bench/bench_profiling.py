"""What profiling costs: a verification-bound collection on the simulator with profiling off, on for
verification only (wall clock, the default: sampled within a 2 % budget), and on for the whole worker
(every thread of the engine process and every verification), side by side in one run.

Side by side means at the same time: each mode is an "arm", a process of its own with its own engine, its
own verifier pool (`--processes` processes) and its own simulator (no latency, so verification is the
limit), and all arms run together over the same measured window. A shared, loaded machine slows every arm
alike at any moment, so the throughput ratio of two arms measures the profiling's cost and not the load
of the moment (runs one after another differ by 30 % under load; this is what made the earlier sequential
design unusable for a 2 % goal). Every arm gets the same share of the CPU, so an arm that needs more CPU
per rollout completes fewer rollouts: the ratio is the throughput a dedicated machine would lose.

Two arms run with profiling off ("off A" and "off B"): their ratio is the measurement's own noise, printed
beside the costs. A "plumbing" arm runs the verification scope with a zero budget (the pool's wrapper, the
session, windows and hand-backs, no verification profiled): it splits what the plumbing costs from what
sampling with yappi costs. CPU per rollout is split between the engine process and its verifier pool. The arms start together after each has warmed up (pool processes, sympy, connections);
rollouts are counted over `--window` seconds after `--warm` seconds (profiling is switched on at the start,
so the window sees it running, as a "profile for 60 s" would). Each round starts fresh arms in a rotated
order; the table gives the median of the per-round ratios, then the figures profiling measured itself.

    .venv/bin/python -m bench.bench_profiling                        # 3 rounds, 30 s windows
    .venv/bin/python -m bench.bench_profiling --rounds 5 --window 40 --json bench/results/profiling.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import CountingSink  # noqa: E402
from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math, task_items  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, ControlState, EndpointSpec  # noqa: E402
from workers.engine.verify_pool import SHARED_VERIFY_POOL  # noqa: E402
from workers.profiling.control import ProfilingControl, ProfilingSink  # noqa: E402
from workers.profiling.core import ProfileConfig, merge_rows  # noqa: E402

ARMS = ("off A", "off B", "plumbing", "verify", "worker")  # arm name -> profiling mode: its first word
LABELS = {"off A": "off (baseline)", "off B": "off again (noise)",
          "plumbing": "verification scope, nothing sampled",
          "verify": "verification only (wall, 2% budget)", "worker": "whole worker (wall)"}
# mode -> (scope, budget %): "plumbing" is the verification scope's wrapper, windows and hand-backs with a zero
# budget (no verification profiled): it splits what the plumbing costs from what sampling with yappi costs
MODES = {"plumbing": ("verify", 0.0), "verify": ("verify", 2.0), "worker": ("worker", 2.0)}


# ------------------------------------------------------------------------------------ one arm
class StopAt:
    """Cancels the run once the measured window is over."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def poll(self) -> ControlState:
        return ControlState(action="cancel" if time.monotonic() >= self.deadline else "run")


def cpu_seconds() -> tuple[float, float]:
    """CPU time of this process (every thread: the engine) and of its verifier processes."""
    engine, pool = sum(psutil.Process().cpu_times()[:2]), 0.0
    ex = SHARED_VERIFY_POOL._executor
    for proc in (getattr(ex, "_processes", None) or {}).values():
        try:
            pool += sum(psutil.Process(proc.pid).cpu_times()[:2])
        except psutil.Error:
            pass
    return engine, pool


async def run_arm(args) -> dict:
    mode = args.arm.split()[0]
    sim = start_simulator(seed=0, ttft_ms=0, itl_ms=0, jitter=0, output_len_min=16, output_len_max=16)
    try:
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim.url], model=sim.model), parallelism=args.c,
                              verifier="math", verify_processes=args.processes, progress_interval_s=1.0)
        await run_collection(spec, task_items(rows_math(300)), CountingSink(times=True), None)  # warm: pool, sympy
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # "go": every arm starts now
        t0 = time.monotonic()
        w0, w1 = t0 + args.warm, t0 + args.warm + args.window
        cpu = {}

        def sample_cpu():
            for key, at in (("start", w0), ("end", w1)):
                time.sleep(max(0.0, at - time.monotonic()))
                cpu[key] = cpu_seconds()
        sampler = threading.Thread(target=sample_cpu, daemon=True)
        sampler.start()
        sink, control, snaps, closing = CountingSink(times=True), StopAt(w1 + 0.5), [], {}
        counter = sink
        if mode != "off":
            scope, budget = MODES[mode]
            cfg = ProfileConfig(session=f"bench-{mode}", scope=scope, clock="wall", budget_pct=budget, window_s=5.0)
            control = ProfilingControl(control, lambda: cfg, snaps.extend, worker="bench",
                                       pool=lambda: SHARED_VERIFY_POOL._executor)
            finish = control.finish

            def timed_finish():  # what ending the session costs (collecting the pool's last rows)
                t = time.monotonic()
                finish()
                closing["finish_ms"] = 1000 * (time.monotonic() - t)
            control.finish = timed_finish
            sink = ProfilingSink(counter, control)
        n = int(args.rate_cap * (args.warm + args.window + 2))  # more than any arm can do in the time
        await run_collection(spec, task_items(rows_math(n)), sink, control)
        sampler.join(5)
        in_window = sum(1 for t in counter.ok_at if w0 <= t < w1)
        out = {"arm": args.arm, "mode": mode, "rollouts": in_window, "rps": in_window / args.window,
               "cpu_ms_per_rollout": 1000 * (sum(cpu["end"]) - sum(cpu["start"])) / max(1, in_window) if len(cpu) == 2 else None,
               "engine_cpu_ms_per_rollout": 1000 * (cpu["end"][0] - cpu["start"][0]) / max(1, in_window) if len(cpu) == 2 else None,
               "pool_cpu_ms_per_rollout": 1000 * (cpu["end"][1] - cpu["start"][1]) / max(1, in_window) if len(cpu) == 2 else None,
               "ran_out": bool(counter.ok_at) and counter.ok_at[-1] < w1 and len(counter.ok_at) >= n, **closing}
        if snaps:
            over = [(s.verifications, s.overhead_pct) for s in snaps if s.overhead_pct is not None]
            rows = merge_rows({}, [r for s in snaps for r in s.rows])
            top = max((r for r in rows.values() if r.name == "MathVerifier.verify"), key=lambda r: r.ttot, default=None)
            out.update(snapshots=len(snaps), verifications=sum(s.verifications for s in snaps),
                       profiled=sum(s.profiled for s in snaps),
                       measured_overhead_pct=(sum(v * o for v, o in over) / max(1, sum(v for v, _ in over))) if over else None,
                       verify_ncall=round(top.ncall) if top else None)
        return out
    finally:
        sim.stop()


# ------------------------------------------------------------------------------- orchestration
def run_round(args, order: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_profiling", "--window", str(args.window), "--warm", str(args.warm),
           "-c", str(args.c), "--processes", str(args.processes), "--rate-cap", str(args.rate_cap)]
    procs = {a: subprocess.Popen(cmd + ["--arm", a], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) for a in order}
    try:
        for a, p in procs.items():  # every arm warmed up before any is measured
            line = "-"
            while line and line.strip() != "ready":
                line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"arm {a} did not start (exit {p.poll()})")
        for p in procs.values():
            p.stdin.write("go\n")
            p.stdin.flush()
        res = {}
        for a, p in procs.items():
            out, _ = p.communicate(timeout=args.warm + args.window + 120)
            last = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not last:
                raise RuntimeError(f"arm {a} failed (exit {p.returncode})")
            res[a] = json.loads(last[-1])
        return res
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def main_orchestrate(args) -> dict:
    arms = [a.strip() for a in args.arms.split(",")]
    if "off A" not in arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: choose among {', '.join(ARMS)} ('off A' is the baseline)")
    rounds = []
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for rnd in range(args.rounds):
        order = list(arms[rnd % len(arms):] + arms[:rnd % len(arms)])
        res = run_round(args, order)
        base = res["off A"]["rps"]
        rounds.append(res)
        v = res.get("verify", {})
        print(f"round {rnd + 1}: " + "  ".join(f"{a} {res[a]['rps']:6.1f}/s ({res[a]['rps'] / base:.3f})" for a in arms)
              + f"  [verify: {v.get('profiled')} of {v.get('verifications')} profiled, measured "
                f"{v.get('measured_overhead_pct') or 0:.2f}%]  load {os.getloadavg()[0]:.1f}", flush=True)
    med = statistics.median
    summary = {"rounds": args.rounds, "window_s": args.window, "warm_s": args.warm, "parallelism": args.c,
               "processes": args.processes, "loadavg_end": os.getloadavg(), "arms": {}, "runs": rounds}

    def cpu_ratio(a, key):
        x = [r[a][key] / r["off A"][key] for r in rounds if r[a].get(key) and r["off A"].get(key)]
        return med(x) if x else None

    for a in arms:
        ratios = [r[a]["rps"] / r["off A"]["rps"] for r in rounds]
        cpu = [r[a]["cpu_ms_per_rollout"] for r in rounds if r[a]["cpu_ms_per_rollout"]]
        summary["arms"][a] = {"rps_median": med(r[a]["rps"] for r in rounds), "ratio_median": med(ratios),
                              "ratios": ratios, "cost_pct": 100 * (1 - med(ratios)),
                              "cpu_ms_per_rollout_median": med(cpu) if cpu else None,
                              "cpu_ratio_median": cpu_ratio(a, "cpu_ms_per_rollout"),
                              "engine_cpu_ratio_median": cpu_ratio(a, "engine_cpu_ms_per_rollout"),
                              "pool_cpu_ratio_median": cpu_ratio(a, "pool_cpu_ms_per_rollout")}
        if "off B" in arms:  # the same cost measured against the other "off" arm
            summary["arms"][a]["cost_vs_off_b_pct"] = 100 * (1 - med(r[a]["rps"] / r["off B"]["rps"] for r in rounds))
    v = [r["verify"] for r in rounds if "verify" in r]
    summary["verify_measured_overhead_pct"] = med(x.get("measured_overhead_pct") or 0.0 for x in v)
    summary["verify_profiled_share_pct"] = 100 * sum(x.get("profiled") or 0 for x in v) / max(1, sum(x.get("verifications") or 0 for x in v))
    summary["verify_finish_ms_median"] = med(x.get("finish_ms") or 0.0 for x in v)
    print()
    print(f"verification-bound collection, arms side by side: simulator (no latency) and math verifier in "
          f"{args.processes} processes per arm, parallelism {args.c}, {args.window:g} s window after {args.warm:g} s, "
          f"{args.rounds} rounds (median of per-round ratios to 'off')")
    print(f"{'profiling':<38}{'rollouts/s':>11}{'vs off':>8}{'cost':>8}{'vs off B':>9}   {'per-round ratios':<{6 * args.rounds + 2}}"
          f"{'CPU ms/rollout':>15}{'vs off':>8}{'engine':>8}{'pool':>8}")
    for a in arms:
        s = summary["arms"][a]
        per = " ".join(f"{x:.3f}" for x in s["ratios"])
        vs_b = f"{s['cost_vs_off_b_pct']:>8.2f}%" if "cost_vs_off_b_pct" in s else " " * 9
        cpu = (f"{s['cpu_ms_per_rollout_median']:>15.2f}{s['cpu_ratio_median']:>8.3f}{s['engine_cpu_ratio_median']:>8.3f}"
               f"{s['pool_cpu_ratio_median']:>8.3f}" if s["cpu_ratio_median"] else "")
        print(f"{LABELS[a]:<38}{s['rps_median']:>11.1f}{s['ratio_median']:>8.3f}{s['cost_pct']:>7.2f}%{vs_b}   "
              f"{per:<{6 * args.rounds + 2}}{cpu}")
    noise = summary["arms"].get("off B", {"ratios": [1.0]})["ratios"]
    print(f"noise (off B vs off A): per-round {min(noise):.3f}..{max(noise):.3f}; verification only: "
          f"{summary['verify_profiled_share_pct']:.2f}% of verifications profiled, cost the profiler measured in the "
          f"pool {summary['verify_measured_overhead_pct']:.2f}%, ending a session {summary['verify_finish_ms_median']:.0f} ms "
          f"(median); load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=30.0, help="measured seconds per round")
    ap.add_argument("--warm", type=float, default=4.0, help="seconds before the window (profiling on, not counted)")
    ap.add_argument("-c", type=int, default=64, help="parallelism per arm")
    ap.add_argument("--processes", type=int, default=2, help="verifier processes per arm")
    ap.add_argument("--rate-cap", type=float, default=600.0, help="rollouts/s no arm reaches (sizes the task list)")
    ap.add_argument("--arms", default=",".join(ARMS), help="arms run side by side (default: all five)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm (the orchestrator starts them)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(asyncio.run(run_arm(args))), flush=True)
        return 0
    summary = main_orchestrate(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
