#!/usr/bin/env python3
"""Model-server operations under streaming load: the dedicated ops client vs the shared rollout session.

    .venv/bin/python -m bench.bench_ops --streams 150,4096 [--seconds 30] [--shared-limit N]

For each stream count N: starts the simulator (slow streams: --ttft-ms/--itl-ms, long outputs) and a
load process that keeps N streaming chat completions open through ONE aiohttp session (connector limit
= --shared-limit, by default N, as the engine sizes its pool to the parallelism). Every second, in the
same run:

* the load process sends an operation through that shared session (how ops calls went out when
  they borrowed the rollout client), and
* this process sends the same operation through `workers.ops.OpsClient` (own connector, a fresh
  connection per operation), half a second later.

Operations alternate between `update_weights` (a 20 ms simulated reload) and `health`. Each records
wall_ms at the client, rpc_ms from the simulator's `Server-Timing: rpc;dur=` header,
queue_ms = wall_ms - rpc_ms, and send_ms: from the call to the request being written on a connection
(the client-side part of queue_ms: waiting for a pooled connection, connecting). The rest of queue_ms is
the network and the time before the server's handler starts (its event loop's lag: large when the
machine's CPUs are oversubscribed). A third path measures that machine share: the dedicated client sends the
same operation at the same moment to a second, idle simulator (no streams); its queue_ms is what the machine
alone costs (scheduling, the loopback), so dedicated minus control is what the streams cost.
`--nice -10` runs the servers, the load and this process at a higher priority so that the machine's other
work cannot delay them. The table gives p50/p95/p99 per path and the ratio of the shared
path's queue_ms p99 to the dedicated one. The open-file limit is raised to its hard limit first (4,096
streams need ~8,200 sockets between the two processes). `--json PATH` keeps the raw samples.
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
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._common import table_lines  # noqa: E402
from bench.simulator_process import start_simulator_process  # noqa: E402

from workers.ops import OpsClient, new_trace_id, parse_server_timing  # noqa: E402
from workers.engine.aggregate import quantile  # noqa: E402

OPS = [("update_weights", "POST", "/update_weights", {"duration_ms": 20}), ("health", "GET", "/health", None)]
MODEL = "sim-model"


def raise_nofile(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(want, soft)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_simulator(args) -> tuple[subprocess.Popen, str]:
    return start_simulator_process("--seed", 0, "--ttft-ms", args.ttft_ms, "--itl-ms", args.itl_ms, "--max-num-seqs",
                                   args.max_num_seqs, "--output-len-min", args.tokens, "--output-len-max", args.tokens,
                                   "--jitter", 0.2)


async def _headers_sent(session, ctx, params):
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["t_sent"] = time.perf_counter()


async def timed_call(session: aiohttp.ClientSession, url: str, op, timeout_s: float) -> dict:
    """One ops request through a given session, timed like OpsClient does it."""
    kind, method, path, body = op
    trace = new_trace_id()
    mark: dict = {}
    t0 = time.perf_counter()
    out = {"kind": kind, "trace_id": trace, "ok": False}
    try:
        async with session.request(method, url + path, json=body, headers={"X-Trace-Id": trace},
                                   timeout=aiohttp.ClientTimeout(total=timeout_s), trace_request_ctx=mark) as r:
            await r.read()
            wall = (time.perf_counter() - t0) * 1000
            rpc = parse_server_timing(r.headers.get("Server-Timing"))
            out.update(ok=r.status == 200, wall_ms=wall, rpc_ms=rpc, queue_ms=None if rpc is None else wall - rpc,
                       send_ms=(mark["t_sent"] - t0) * 1000 if "t_sent" in mark else None)
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        out.update(error=type(e).__name__, wall_ms=(time.perf_counter() - t0) * 1000)
    return out


# ------------------------------------------------------------------------------------------ load side
async def load_main(url: str, streams: int, limit: int, warmup: float, seconds: float, op_timeout: float) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True}
    state = {"open": 0, "done": 0, "errors": 0}
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0)
    samples: list[dict] = []
    tc = aiohttp.TraceConfig()
    tc.on_request_headers_sent.append(_headers_sent)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                     trace_configs=[tc]) as session:
        async def stream_worker():
            while not stop.is_set():
                try:
                    state["open"] += 1  # a request on a connection of the shared pool (queued or streaming)
                    try:
                        async with session.post(url + "/v1/chat/completions", json=body) as r:
                            async for _ in r.content.iter_any():
                                pass
                    finally:
                        state["open"] -= 1
                    state["done"] += 1
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    state["errors"] += 1
                    await asyncio.sleep(0.1)

        workers = [asyncio.create_task(stream_worker()) for _ in range(streams)]
        # warm-up: until the server holds (nearly) every stream (running + waiting), then a few more seconds
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            try:
                async with session.get(url + "/load", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if (await r.json()).get("server_load", 0) >= 0.95 * streams:
                        break
            except (asyncio.TimeoutError, aiohttp.ClientError):
                pass
        await asyncio.sleep(warmup)
        print(json.dumps({"ready": True, "open": state["open"]}), flush=True)
        t_end = time.monotonic() + seconds
        i = 0
        pending = []
        while time.monotonic() < t_end:
            op = OPS[i % len(OPS)]
            i += 1
            open_now = state["open"]

            async def one(op=op, open_now=open_now):
                s = await timed_call(session, url, op, op_timeout)
                s["streams_open"] = open_now
                samples.append(s)
            pending.append(asyncio.create_task(one()))
            await asyncio.sleep(1.0)
        await asyncio.gather(*pending)
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return {"samples": samples, "streams_done": state["done"], "stream_errors": state["errors"]}


# ------------------------------------------------------------------------------------------ main side
async def dedicated_main(url: str, seconds: float, op_timeout: float, load_proc,
                         control_url: str | None = None) -> tuple[list[dict], list[dict]]:
    """The dedicated client's ops on the loaded server and, at the same moment, on the idle control server."""
    samples, control = [], []
    async with OpsClient(timeouts={k: op_timeout for k, *_ in OPS}, max_retries=0) as client:
        await asyncio.sleep(0.5)
        t_end = time.monotonic() + seconds
        i = 0
        pending = []
        while time.monotonic() < t_end:
            kind, method, path, body = OPS[i % len(OPS)]
            i += 1

            async def one(target, into, kind=kind, method=method, path=path, body=body):
                r = await client.call(target, method, path, kind=kind, json_body=body)
                into.append({"kind": kind, "ok": r.ok, "wall_ms": r.wall_ms, "rpc_ms": r.rpc_ms,
                             "queue_ms": r.queue_ms, "connect_ms": r.connect_ms, "send_ms": r.send_ms,
                             "error": r.error, "t": time.monotonic()})
            pending.append(asyncio.create_task(one(url, samples)))
            if control_url:
                pending.append(asyncio.create_task(one(control_url, control)))
            await asyncio.sleep(1.0)
        await asyncio.gather(*pending)
    return samples, control


def pct(values, q):
    v = sorted(x for x in values if x is not None)
    return quantile(v, q) if v else float("nan")


def summarize(samples: list[dict]) -> dict:
    ok = [s for s in samples if s.get("ok")]
    out = {"n": len(samples), "failed": len(samples) - len(ok)}
    for key in ("queue_ms", "send_ms", "rpc_ms", "wall_ms"):
        for q in (0.5, 0.95, 0.99):
            out[f"{key}_p{int(q * 100)}"] = pct([s.get(key) for s in ok], q)
    return out


def renice(pid: int, nice: int) -> None:
    if nice:
        os.setpriority(os.PRIO_PROCESS, pid, nice)


def run_level(args, streams: int) -> dict:
    sim, url = start_simulator(args)
    control_sim, control_url = start_simulator(args)  # same server, no streams: what the machine alone costs
    renice(sim.pid, args.nice)
    renice(control_sim.pid, args.nice)
    limit = args.shared_limit or streams
    try:
        load = subprocess.Popen([sys.executable, "-m", "bench.bench_ops", "--role", "load", "--url", url,
                                 "--streams", str(streams), "--shared-limit", str(limit), "--warmup", str(args.warmup),
                                 "--seconds", str(args.seconds), "--op-timeout", str(args.op_timeout)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
        renice(load.pid, args.nice)
        ready = json.loads(load.stdout.readline() or "{}")
        if not ready.get("ready"):
            raise SystemExit("the load process did not start")
        dedicated, control = asyncio.run(dedicated_main(url, args.seconds, args.op_timeout, load, control_url))
        shared_out = json.loads(load.stdout.read() or "{}")
        load.wait(timeout=120)
    finally:
        for proc in (sim, control_sim):
            proc.terminate()
            proc.wait(timeout=30)
    shared = shared_out.get("samples", [])
    return {"streams": streams, "shared_limit": limit, "streams_open_at_ops": [s.get("streams_open") for s in shared],
            "streams_done": shared_out.get("streams_done"), "stream_errors": shared_out.get("stream_errors"),
            "dedicated": summarize(dedicated), "shared": summarize(shared), "control": summarize(control),
            "loadavg": os.getloadavg(), "raw": {"dedicated": dedicated, "shared": shared, "control": control}}


def fmt(v):
    return "—" if v != v else (f"{v:,.0f}" if v >= 100 else f"{v:.1f}")


def table(results: list[dict]) -> str:
    head = ("streams", "path", "ops", "fail", "queue p50", "queue p95", "queue p99", "send p50", "send p99",
            "rpc p50", "rpc p99", "wall p50", "wall p99")
    rows = []
    for r in results:
        for path in ("dedicated", "shared", "control"):
            s = r[path]
            name = {"dedicated": "dedicated", "shared": f"shared (pool {r['shared_limit']:,})",
                    "control": "dedicated, idle server (control)"}[path]
            rows.append((f"{r['streams']:,}", name,
                         str(s["n"]), str(s["failed"]), fmt(s["queue_ms_p50"]), fmt(s["queue_ms_p95"]),
                         fmt(s["queue_ms_p99"]), fmt(s["send_ms_p50"]), fmt(s["send_ms_p99"]), fmt(s["rpc_ms_p50"]), fmt(s["rpc_ms_p99"]), fmt(s["wall_ms_p50"]),
                         fmt(s["wall_ms_p99"])))
    lines = table_lines(head, rows, left=2)
    lines.append("")
    for r in results:
        d, s = r["dedicated"]["queue_ms_p99"], r["shared"]["queue_ms_p99"]
        opened = [x for x in r["streams_open_at_ops"] if x is not None]
        c = r["control"]["queue_ms_p99"]
        lines.append(f"{r['streams']:,} streams: dedicated queue_ms p99 {fmt(d)} vs {fmt(c)} on the idle control server at "
                     f"the same moments (the streams' own share: {fmt(max(0.0, d - c))} ms); load average "
                     f"{' '.join(f'{x:.1f}' for x in r['loadavg'])}")
        lines.append(f"{r['streams']:,} streams: shared/dedicated queue_ms p99 = {s / d if d else float('nan'):.1f}x; "
                     f"streams open when ops went out: min {min(opened, default=0):,}, max {max(opened, default=0):,}; "
                     f"streams completed {r['streams_done']:,}, stream errors {r['stream_errors']:,}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="150,4096", help="comma-separated stream counts (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=30.0, help="measuring time per level (one op per second per path)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds to wait, once the server holds every stream, before measuring")
    p.add_argument("--shared-limit", type=int, default=0, help="connection limit of the shared session (0 = streams)")
    p.add_argument("--ttft-ms", type=float, default=200.0)
    p.add_argument("--itl-ms", type=float, default=400.0)
    p.add_argument("--tokens", type=int, default=25, help="output tokens per stream")
    p.add_argument("--max-num-seqs", type=int, default=256, help="simulator capacity; the rest of the streams wait in its queue")
    p.add_argument("--op-timeout", type=float, default=60.0, help="timeout per op on both paths")
    p.add_argument("--nice", type=int, default=0, help="run the servers, the load and this process at this nice "
                   "level (e.g. -10: the machine's other load cannot delay them; isolates the product's own cost)")
    p.add_argument("--json", help="write the results (with raw samples) here")
    p.add_argument("--role", default="main", choices=["main", "load"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    levels = [int(x) for x in str(args.streams).split(",") if x.strip()]
    nofile = raise_nofile(2 * max(levels) + 256)
    if args.role == "load":
        out = asyncio.run(load_main(args.url, levels[0], args.shared_limit or levels[0], args.warmup, args.seconds,
                                    args.op_timeout))
        print(json.dumps(out), flush=True)
        return 0
    renice(os.getpid(), args.nice)
    if nofile < 2 * max(levels) + 256:
        print(f"warning: open-file limit {nofile} is below what {max(levels)} streams need", file=sys.stderr)
    results = []
    for n in levels:
        print(f"... {n} streams ({args.seconds:g} s, warm-up {args.warmup:g} s)", file=sys.stderr, flush=True)
        results.append(run_level(args, n))
    print(f"ops under streaming load (simulator ttft {args.ttft_ms:g} ms, itl {args.itl_ms:g} ms, "
          f"{args.tokens} tokens/stream, max_num_seqs {args.max_num_seqs}); ms")
    print(table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
