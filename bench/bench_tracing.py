"""What OpenTelemetry tracing costs the collection (issue 27, "Bench"): the engine against the simulator with
tracing off, on without an exporter (spans made and dropped: TRACING_MODE "spans") and on with OTLP export
(batched protobuf over HTTP to a collector in a process of its own, which keeps the requests and decodes them
after the runs, as a collector on another host would spend its CPU there), interleaved.

Each round runs every arm once, in an order shuffled per round (seeded: no arm always follows the same one), in this
one process (one engine, one simulator process at zero latency by default, verifier "none" so that the engine's own
work -- where the spans are made -- is the limit): a run collects `-n` rollouts at concurrency `-c`, on the event
loop and with the garbage collector's settings of a production run (workers.engine.loop.run, as the Celery task runs
it: uvloop where installed, the collector tuned; `--loop asyncio` for asyncio's own). Under plain asyncio.run the
collector keeps its default thresholds: a full collection of this process (30-45 ms, about one run in three at 3000
rollouts) then lands in whichever arm is running and moves its CPU per rollout by ~5 %, more than the overhead
measured. Two arms run with tracing off ("off A", "off B"): their ratio is the measurement's own noise on a shared
machine. Per arm, the median over the rounds of:

* rollouts/s  rollouts / the run's wall time (the simulator shares the CPU, as a vLLM server would not);
* CPU ms/rollout  this process's CPU time (every thread) per rollout: what the engine spends, less sensitive to
  the load of the moment than the throughput;
* exporter CPU ms/rollout  the OTLP exporter subprocess's CPU time (workers/tracing_export.py: it builds,
  encodes and sends the spans) per rollout -- off the worker's CPU path, but on this 2-core machine it shares
  the CPU with the engine and the simulator.

The ratios are the medians over the rounds of each arm's value over the "off A" run of the same round (this shared
machine drifts between rounds, by up to 2x in throughput). Goal: overhead <= 2 %.

    .venv/bin/python -m bench.bench_tracing                       # 5 rounds of 3000 rollouts at c=64
    .venv/bin/python -m bench.bench_tracing --rounds 7 -n 5000 --json bench/results/tracing.json
    .venv/bin/python -m bench.bench_tracing -n 1000 --ttft-ms 200 --itl-ms 20   # the model server is the limit
    .venv/bin/python -m bench.bench_tracing --command --rounds 9 -n 5000         # the whole collect_rollouts

`--command` runs the product's collection as a user runs it: `manage.py collect_rollouts` (a job in a fresh
SQLite database, every rollout stored and appended to the output file, +resume=false on one ingested file, verifier
`--verifier`, "none" by default so that the engine and its sink stay the limit), the arm set by the deployment's
settings (TRACING_MODE, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, TRACING_SAMPLE_RATIO). Rollouts/s counts from the
simulator's first request to the command's exit; CPU is every process of the command (the OTLP exporter included,
followed to its end) per rollout, start-up included (the same in every arm).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import CountingSink  # noqa: E402
from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math, task_items  # noqa: E402
from workers.engine.loop import loop_factory  # noqa: E402
from workers.engine.loop import run as run_on_loop  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402
from workers.tracing import TraceConfig  # noqa: E402
from workers.tracing_export import stats as exporter_stats  # noqa: E402

ARMS = ("off A", "off B", "spans", "otlp", "otlp 10%")
LABELS = {
    "off A": "off (baseline)",
    "off B": "off again (noise)",
    "spans": "on, no exporter",
    "otlp": "on, OTLP/HTTP export",
    "otlp 10%": "on, OTLP, 10% sampled",
}

COLLECTOR = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, %r)
    from tests.otlp_collector import start_collector
    col = start_collector(decode="later")  # decoded after the runs: a collector's CPU is not the worker's
    print(col.url, flush=True)
    sys.stdin.readline()
    col.decode_kept()
    print(col.requests, len(col.spans), col.bytes, flush=True)
""")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far; OSError when it is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _exporter_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's exporter subprocesses."""
    total = 0.0
    for pid in exporter_stats()["pids"]:
        try:
            total += _cpu_s(pid)
        except (OSError, IndexError, ValueError):
            pass
    return total


async def one_run(arm: str, url: str, model: str, collector_url: str, n: int, c: int) -> dict:
    tracing = None
    if arm == "spans":
        tracing = TraceConfig(mode="spans", job_key="bench", attributes={"job.id": 1})
    elif arm.startswith("otlp"):
        tracing = TraceConfig(
            mode="otlp",
            endpoint=collector_url,
            job_key="bench",
            attributes={"job.id": 1},
            sample_ratio=0.1 if arm.endswith("%") else 1.0,
        )
    spec = CollectionSpec(
        endpoint=EndpointSpec(base_urls=[url], model=model),
        parallelism=c,
        verifier="none",
        progress_interval_s=1.0,
        tracing=tracing,
    )
    sink = CountingSink()
    cpu0, xcpu0, dropped0, t0 = time.process_time(), _exporter_cpu_s(), exporter_stats()["dropped"], time.monotonic()
    summary = await run_collection(spec, task_items(rows_math(n)), sink, None)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0  # includes the final flush of the export
    xcpu = _exporter_cpu_s() - xcpu0
    return {
        "arm": arm,
        "rollouts": sink.ok,
        "failed": summary.failed,
        "wall_s": wall,
        "rps": sink.ok / wall,
        "cpu_ms_per_rollout": 1000 * cpu / max(1, sink.ok),
        "exporter_cpu_ms_per_rollout": 1000 * xcpu / max(1, sink.ok),
        "dropped_spans": exporter_stats()["dropped"] - dropped0,
    }


def _tree_cpu(pids: set[int], seen: dict[int, float], exporter: set[int]) -> None:
    """Update `seen` (pid -> CPU seconds so far) for `pids` and their children; note the OTLP exporter's pids."""
    todo = list(pids)
    while todo:
        pid = todo.pop()
        try:
            seen[pid] = _cpu_s(pid)
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
            if pid not in exporter:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"tracing_export" in f.read():
                        exporter.add(pid)
        except (OSError, IndexError, ValueError):
            continue
        pids.update(kids)
        todo.extend(k for k in kids if k not in seen)


def command_run(arm: str, cmd: list[str], env: dict, sim_url: str, collector_url: str, n: int) -> dict:
    """One `collect_rollouts` command under `arm`'s tracing settings: its collection rate and CPU per rollout."""
    from bench.bench_collection import FirstRequest

    env = dict(
        env,
        TRACING_MODE="off" if arm.startswith("off") else "spans" if arm == "spans" else "otlp",
        TRACING_SAMPLE_RATIO="0.1" if arm.endswith("%") else "1.0",
    )
    if arm.startswith("otlp"):
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = collector_url
    first = FirstRequest(sim_url)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids, seen, exporter = {proc.pid}, {}, set()
    while proc.poll() is None:
        _tree_cpu(pids, seen, exporter)
        time.sleep(0.05)
    t_end = time.monotonic()
    err = proc.stderr.read()
    deadline = time.monotonic() + 10  # the exporter's last flush ends after the command: follow it to its end
    while exporter and time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in exporter):
        _tree_cpu(set(exporter), seen, exporter)
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"{arm}: collect_rollouts exited {proc.returncode}:\n{err[-3000:]}")
    wall = t_end - first.stop()
    cpu, xcpu = sum(seen.values()), sum(seen.get(p, 0.0) for p in exporter)
    return {
        "arm": arm,
        "rollouts": n,
        "failed": 0,
        "wall_s": wall,
        "rps": n / wall,
        "cpu_ms_per_rollout": 1000 * cpu / n,
        "exporter_cpu_ms_per_rollout": 1000 * xcpu / n,
        "dropped_spans": 0,
    }


def command_setup(tmp: str, n: int, c: int, verifier: str, sim_url: str, model: str) -> tuple[list[str], dict]:
    """A fresh SQLite database, a file of `n` math tasks ingested by an untimed first command: the command and
    environment of each timed run (+resume=false: a fresh job on the same dataset)."""
    from bench.bench_cli import make_file

    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp}/bench.sqlite3",
        "PYTHONUNBUFFERED": "1",
        "TRACING_MODE": "off",
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # modules load from cached bytecode, as on a user's machine
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    path = os.path.join(tmp, "tasks.jsonl")
    make_file(path, n, 7)
    cmd = [
        sys.executable,
        "manage.py",
        "collect_rollouts",
        f"+input_jsonl_fpath={path}",
        f"+output_jsonl_fpath={tmp}/out.jsonl",
        f"+model_base_url={sim_url}/v1",
        f"+model_name={model}",
        f"+num_samples_in_parallel={c}",
        f"+verifier={verifier}",
        "+resume=false",
    ]
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, capture_output=True
    )
    warm = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)  # untimed: ingest, bytecode
    if warm.returncode != 0:
        raise SystemExit(f"collect_rollouts exited {warm.returncode}:\n{warm.stderr[-3000:]}")
    return cmd, env


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3000, help="rollouts per run")
    ap.add_argument("-c", type=int, default=64, help="concurrency")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--ttft-ms",
        type=float,
        default=0.0,
        help="the simulator's time to first token (0: the worker's CPU is the limit, the worst case for tracing)",
    )
    ap.add_argument("--itl-ms", type=float, default=0.0, help="the simulator's time between tokens (16 tokens)")
    ap.add_argument("--loop", default="", help="uvloop or asyncio (default: the engine's, $ENGINE_EVENT_LOOP)")
    ap.add_argument("--json", help="write the runs and the table here")
    ap.add_argument(
        "--command",
        action="store_true",
        help="time whole `manage.py collect_rollouts` commands (storage included) instead of the engine",
    )
    ap.add_argument("--verifier", default="none", help="with --command: the job's verifier")
    args = ap.parse_args()

    sim = start_simulator(
        seed=0, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, jitter=0, output_len_min=16, output_len_max=16
    )
    col = subprocess.Popen(
        [sys.executable, "-c", COLLECTOR % ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    collector_url = col.stdout.readline().strip()
    runs: list[dict] = []
    tmp = tempfile.TemporaryDirectory(prefix="bench_tracing_")
    try:
        if args.command:
            cmd, env = command_setup(tmp.name, args.n, args.c, args.verifier, sim.url, sim.model)
        else:
            run_on_loop(one_run("otlp", sim.url, sim.model, collector_url, 500, args.c), args.loop)  # warm: imports
        for r in range(args.rounds):
            order = list(ARMS)
            random.Random(r).shuffle(order)  # no arm always follows the same one (what ran before moves the next)
            for arm in order:
                if args.command:
                    res = command_run(arm, cmd, env, sim.url, collector_url, args.n)
                else:
                    res = run_on_loop(one_run(arm, sim.url, sim.model, collector_url, args.n, args.c), args.loop)
                res["round"] = r
                runs.append(res)
                print(
                    f"round {r} {arm:8s} {res['rps']:8.1f} rollouts/s  {res['cpu_ms_per_rollout']:6.3f} CPU ms/rollout  "
                    f"{res['exporter_cpu_ms_per_rollout']:6.3f} exporter CPU ms/rollout  {res['dropped_spans']} dropped",
                    flush=True,
                )
        col.stdin.write("\n")
        col.stdin.flush()
        exported = col.stdout.readline().split()
    finally:
        sim.stop()
        col.kill()
        tmp.cleanup()

    med = {
        arm: {
            k: statistics.median(x[k] for x in runs if x["arm"] == arm)
            for k in ("rps", "cpu_ms_per_rollout", "exporter_cpu_ms_per_rollout")
        }
        for arm in ARMS
    }
    base = {x["round"]: x for x in runs if x["arm"] == "off A"}

    def ratio(arm: str, key: str) -> float:
        return statistics.median(x[key] / base[x["round"]][key] for x in runs if x["arm"] == arm)

    what = (
        f"whole collect_rollouts commands (SQLite), verifier {args.verifier}"
        if args.command
        else f"the engine, loop {'asyncio' if loop_factory(args.loop) is None else 'uvloop'}, verifier none"
    )
    print(
        f"\nTracing overhead: {args.rounds} rounds x {args.n} rollouts at concurrency {args.c}, {what}, "
        f"simulator TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms x 16 tokens (medians)\n"
    )
    print(
        f"{'arm':26s} {'rollouts/s':>11s} {'ratio':>7s} {'CPU ms/rollout':>15s} {'ratio':>7s} {'exporter CPU ms':>16s}"
    )
    table = []
    for arm in ARMS:
        m = med[arm]
        row = {
            "arm": arm,
            "label": LABELS[arm],
            "rps": m["rps"],
            "rps_ratio": ratio(arm, "rps"),
            "cpu_ms_per_rollout": m["cpu_ms_per_rollout"],
            "cpu_ratio": ratio(arm, "cpu_ms_per_rollout"),
            "exporter_cpu_ms_per_rollout": m["exporter_cpu_ms_per_rollout"],
        }
        table.append(row)
        print(
            f"{LABELS[arm]:26s} {row['rps']:11.1f} {row['rps_ratio']:7.3f} {row['cpu_ms_per_rollout']:15.3f} "
            f"{row['cpu_ratio']:7.3f} {row['exporter_cpu_ms_per_rollout']:16.3f}"
        )
    if len(exported) == 3:
        print(
            f"\ncollector received {exported[1]} spans in {exported[0]} exports ({int(exported[2]) / 1e6:.1f} MB); "
            f"dropped by the worker: {exporter_stats()['dropped']}; load average {os.getloadavg()}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "table": table, "exported": exported}, f, indent=1)


if __name__ == "__main__":
    main()
