#!/usr/bin/env python3
"""How fast is the simulator itself? Zero latency, driven from this (separate) client process.

    .venv/bin/python bench/bench_simulator.py [--requests 5000] [--concurrency 64] [--max-tokens 16]

Starts `python -m workers.simulator --ttft-ms 0 --itl-ms 0` as a subprocess on a free port (or uses
--url), sends chat completions with aiohttp at the given concurrency, plain then streaming (with
include_usage), and prints req/s and p50/p99 latency per mode. The simulator must not be the
bottleneck of anything measured against it; on a shared 2-core box the client and the server compete
for the same cores, so the figure is a lower bound.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.simulator_process import start_simulator_process  # noqa: E402


def start_simulator(extra: list[str]) -> tuple[subprocess.Popen, str]:
    return start_simulator_process("--ttft-ms", 0, "--itl-ms", 0, "--seed", 0, *extra)


async def drive(url: str, n: int, concurrency: int, max_tokens: int, stream: bool, model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "What is 12 + 30? Answer briefly."}],
            "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    lat: list[float] = []
    errors = 0
    left = n
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def worker():
            nonlocal left, errors
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        data = await r.read()
                        ok = r.status == 200 and (not stream or data.endswith(b"data: [DONE]\n\n"))
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return wall, lat, errors


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000, help="requests per mode (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--url", help="bench an already running server instead of starting the simulator")
    ap.add_argument("--model", default="sim-model")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_simulator(["--model", args.model])
    try:
        asyncio.run(drive(url, 300, args.concurrency, args.max_tokens, False, args.model))  # warm-up
        rows = []
        server = psutil.Process(proc.pid) if proc is not None else None
        for mode in ("plain", "stream"):
            s0 = sum(server.cpu_times()[:2]) if server else float("nan")
            c0 = time.process_time()
            wall, lat, errors = asyncio.run(drive(url, args.requests, args.concurrency, args.max_tokens,
                                                  mode == "stream", args.model))
            c1 = time.process_time()
            s1 = sum(server.cpu_times()[:2]) if server else float("nan")
            rows.append((mode, args.requests, args.concurrency, len(lat) / wall, pct(lat, 50) * 1000,
                         pct(lat, 99) * 1000, errors, (s1 - s0) / args.requests * 1e6,
                         (c1 - c0) / args.requests * 1e6))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(5)
    print(f"simulator at zero latency ({url}), {os.cpu_count()} cores, max_tokens={args.max_tokens}")
    print("(server/client CPU: CPU time per request of the simulator process and of this client process;"
          " server req/s capacity ~ 1e6 / server CPU)")
    print(f"{'mode':<8} {'requests':>8} {'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}"
          f" {'server CPU us/req':>18} {'client CPU us/req':>18}")
    for mode, n, c, rps, p50, p99, err, scpu, ccpu in rows:
        print(f"{mode:<8} {n:>8} {c:>5} {rps:>9.0f} {p50:>8.2f} {p99:>8.2f} {err:>6} {scpu:>18.0f} {ccpu:>18.0f}")
    return 0 if all(r[6] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
