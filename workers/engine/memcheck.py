"""Memory flatness check: the engine's peak RSS for several dataset sizes against the simulator.

    python -m workers.engine.memcheck --sizes 10000,50000,200000 [--parallelism 64] [--url URL]

Without --url it starts `python -m workers.simulator` at zero latency on a free port. Each size runs
in a fresh child process (peak RSS never goes down inside a process) that streams tasks from a
generator into the engine with a sink that only counts, then reports its peak RSS (ru_maxrss) and
throughput. Flat memory means the peak RSS barely moves while the task count grows 20x.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time

from .runner import run_collection
from .types import CollectionSpec, EndpointSpec, TaskItem


class _CountingSink:
    def __init__(self):
        self.n = 0
        self.failed = 0
        self.max_resident = 0

    async def rollout(self, result):
        self.n += 1
        self.failed += not result.ok

    async def progress(self, tick):
        self.max_resident = max(self.max_resident, tick.extra.get("resident", 0))

    async def close(self):
        pass


def _tasks(n: int):
    for i in range(n):
        a, b = i % 97, i % 89
        row = {"responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + {b}?"}]},
               "expected_answer": str(a + b)}
        yield TaskItem(task_index=i, rollout_index=0, row=row)


def _child(n: int, url: str, model: str, parallelism: int, verifier: str, stream: bool) -> dict:
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[url], model=model), parallelism=parallelism,
                          verifier=verifier, stream=stream, responses_create_params={"max_output_tokens": 8})
    sink = _CountingSink()
    t0 = time.monotonic()
    summary = asyncio.run(run_collection(spec, _tasks(n), sink))
    secs = time.monotonic() - t0
    return {"tasks": n, "completed": summary.completed, "failed": summary.failed, "secs": round(secs, 1),
            "rollouts_per_s": round(summary.completed / secs, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "max_resident": sink.max_resident, "fatal_error": summary.fatal_error}


def _start_simulator() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "workers.simulator", "--host", "127.0.0.1", "--port", "0",
                             "--ttft-ms", "0", "--itl-ms", "0", "--jitter", "0", "--seed", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"simulator did not start: {line!r}")
    return proc, "http://" + line.split("http://", 1)[1].split()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,200000", help="comma-separated task counts")
    ap.add_argument("--parallelism", type=int, default=64)
    ap.add_argument("--verifier", default="exact")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--url", help="a running server (default: start the simulator)")
    ap.add_argument("--model", default="sim-model")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.url, args.model, args.parallelism, args.verifier, not args.no_stream)))
        return 0
    proc, url = (None, args.url) if args.url else _start_simulator()
    try:
        rows = []
        for n in [int(x) for x in args.sizes.split(",")]:
            cmd = [sys.executable, "-m", "workers.engine.memcheck", "--child", str(n), "--url", url, "--model", args.model,
                   "--parallelism", str(args.parallelism), "--verifier", args.verifier] + (["--no-stream"] if args.no_stream else [])
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['tasks']:>8} tasks  {r['completed']:>8} ok  {r['failed']:>5} failed  {r['secs']:>7}s  "
                  f"{r['rollouts_per_s']:>8}/s  peak RSS {r['peak_rss_mb']:>7} MB  max resident {r['max_resident']}",
                  flush=True)
        if len(rows) > 1:
            print(f"peak RSS ratio largest/smallest: {rows[-1]['peak_rss_mb'] / rows[0]['peak_rss_mb']:.3f}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
