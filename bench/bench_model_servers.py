"""Model servers side by side: the simulator at zero latency vs real vLLM on CPU (tiny model).

Starts both servers itself on free loopback ports, drives each with the bare client
(`bench.bare_client.run_bare`) at concurrency 1, 64 and 512, stops them, and prints one table:
requests/s and p50/p99 latency per server and concurrency. Takes about 1-3 minutes on 2 cores.

    .venv/bin/python -m bench.bench_model_servers
    .venv/bin/python -m bench.bench_model_servers --only sim -c 1,64,512,2048 --json bench/results/servers.json

Needs `bash scripts/vllm_cpu.sh setup` for the vLLM half (or `--only sim`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.bare_client import percentile, run_bare, synthetic_rows  # noqa: F401  (percentile re-exported)

ROOT = Path(__file__).resolve().parent.parent
# Requests per level, sized so each level runs a few seconds: vLLM on CPU does ~20-300 req/s, the
# zero-latency simulator thousands.
DEFAULT_N = {
    "simulator": {1: 2000, 64: 10000, 512: 10240},
    "vllm-cpu": {1: 100, 64: 1000, 512: 2048},
}


class Server:
    def __init__(self, name: str, url: str, model: str, stop):
        self.name, self.url, self.model, self._stop = name, url, model, stop

    def stop(self) -> None:
        self._stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_simulator(max_num_seqs: int) -> Server:
    """`python -m workers.simulator` with zero latency; the URL is read from its ready line."""
    log = tempfile.NamedTemporaryFile(prefix="bench-sim-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.simulator", "--host", "127.0.0.1", "--port", "0", "--model", "sim-model",
         "--ttft-ms", "0", "--itl-ms", "0", "--jitter", "0", "--seed", "0", "--max-num-seqs", str(max_num_seqs)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    line: list[str] = []
    t = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(20)

    def stop():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        os.unlink(log.name)

    if not line or "http://" not in line[0]:
        err = Path(log.name).read_text(errors="replace")[-2000:]
        stop()
        raise RuntimeError(f"the simulator did not start: {err}")
    url = "http://" + line[0].split("http://", 1)[1].split()[0].rstrip("/")
    return Server("simulator", url, "sim-model", stop)


def start_vllm(timeout_s: int) -> Server:
    """Real vLLM on CPU through scripts/vllm_cpu.sh, in its own run dir so it does not touch a dev server."""
    run_dir = tempfile.mkdtemp(prefix="bench-vllm-")
    port = _free_port()
    env = dict(os.environ, VLLM_RUN_DIR=run_dir, VLLM_START_TIMEOUT=str(timeout_s))
    script = ["bash", str(ROOT / "scripts" / "vllm_cpu.sh")]

    def stop():
        subprocess.run(script + ["stop"], cwd=ROOT, env=env, capture_output=True, timeout=60)

    t0 = time.monotonic()
    proc = subprocess.run(script + ["start", str(port)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s + 30)
    if proc.returncode != 0:
        stop()
        raise RuntimeError(f"vLLM did not start:\n{proc.stderr[-3000:]}")
    print(f"  vLLM ready in {time.monotonic() - t0:.0f} s (log {run_dir}/vllm.log)", file=sys.stderr)
    return Server("vllm-cpu", f"http://127.0.0.1:{port}", "tiny", stop)


async def bench_server(server: Server, levels: list[int], n_for, max_tokens: int, verify: bool) -> dict[int, dict]:
    rows = synthetic_rows(512)
    # ignore_eos: the random-weight model may emit its EOS early; every request makes max_tokens tokens
    # on both servers (the simulator makes exactly max_tokens anyway).
    extra = {"ignore_eos": True, "temperature": 0.0}
    await run_bare(server.url, server.model, rows, 8, max_tokens, n=16, extra_body=extra)  # warm-up
    out = {}
    for c in levels:
        r = await run_bare(server.url, server.model, rows, c, max_tokens, verify, n=n_for(server.name, c), extra_body=extra)
        print(f"  {server.name:9s} c={c:<4d} n={r['n']:<5d} {r['rps']:8.1f} req/s  p50 {r['latency_ms']['p50']:7.1f} ms  "
              f"p99 {r['latency_ms']['p99']:7.1f} ms  errors {r['errors'] or 0}", file=sys.stderr)
        out[c] = r
    return out


def side_by_side(results: dict[str, dict[int, dict]], levels: list[int]) -> str:
    names = list(results)
    head = ["conc"]
    for name in names:
        head += [f"{name} n", f"{name} req/s", f"{name} p50 ms", f"{name} p99 ms"]
    rows = []
    for c in levels:
        cells = [str(c)]
        for name in names:
            r = results[name].get(c)
            if r is None:
                cells += ["-"] * 4
                continue
            err = sum(r["errors"].values())
            cells += [f"{r['n']}" + (f" ({err} err)" if err else ""), f"{r['rps']:.1f}",
                      f"{r['latency_ms']['p50']:.1f}", f"{r['latency_ms']['p99']:.1f}"]
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_model_servers", description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--concurrency", default="1,64,512", help="comma-separated levels (default 1,64,512)")
    p.add_argument("-n", "--requests", type=int, default=None,
                   help="requests per level and server (default: simulator 2000/10000/10240 and vLLM 100/1000/2048 "
                   "at c=1/64/512; other levels 20*c and 4*c)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--only", choices=["sim", "vllm"], default=None, help="bench one server only")
    p.add_argument("--sim-max-num-seqs", type=int, default=512, help="simulator capacity (default 512)")
    p.add_argument("--verify", action="store_true", help="also score answers with the math verifier (process pool)")
    p.add_argument("--vllm-start-timeout", type=int, default=240, help="seconds to wait for vLLM /health (default 240)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write all results as JSON to PATH")
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency: not a list of integers: {args.concurrency!r}")
    if not levels or any(c < 1 for c in levels):
        p.error("--concurrency values must be >= 1")

    def n_for(server: str, c: int) -> int:
        return args.requests or DEFAULT_N[server].get(c, (20 if server == "simulator" else 4) * c)

    results: dict[str, dict[int, dict]] = {}
    t0 = time.monotonic()
    starters = [("simulator", lambda: start_simulator(args.sim_max_num_seqs)), ("vllm-cpu", lambda: start_vllm(args.vllm_start_timeout))]
    if args.only:
        starters = [s for s in starters if s[0].startswith(args.only)]
    for name, start in starters:
        print(f"starting {name} ...", file=sys.stderr)
        server = start()
        try:
            results[name] = asyncio.run(bench_server(server, levels, n_for, args.max_tokens, args.verify))
        finally:
            server.stop()
    print(f"\nmodel servers: chat completions, {args.max_tokens} output tokens each (ignore_eos), bare aiohttp client, "
          f"{os.cpu_count()} CPUs shared by client and server; bench took {time.monotonic() - t0:.0f} s")
    print(side_by_side(results, levels))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({k: {str(c): r for c, r in v.items()} for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
