"""Time from `manage.py collect_rollouts`'s start to its first request at the model server (issue 28: < 1 s).

The bench starts the built-in simulator and, in front of it, a TCP forwarder of its own that notes the moment the
first bytes of the first HTTP request arrive (and of the first POST: the first completion) and the request line.
Each run is the whole drop-in command, a subprocess started by the bench (the clock starts just before Popen):
    python manage.py collect_rollouts +input_jsonl_fpath=FILE ... +model_base_url=<forwarder>/v1 +verifier=math
on a fresh SQLite file migrated before the clock (the laptop default) or --db. "first" runs a file the product
has never seen (ingested inside the command), "rerun" the same file again with +resume=false. One untimed run per
checkout first, with PYTHONDONTWRITEBYTECODE taken out of the commands' environment (unless --no-bytecode): the
modules then load from cached bytecode, as on a user's machine from the second command on.

Several checkouts can be compared, interleaved run by run (`--checkout before=/tmp/old-tree`): each is run with
its own manage.py and the same interpreter. Figures per run: seconds to the first request, to the first POST, and
the command's CPU seconds (user + system, all its threads, read from /proc when the first request arrives: a figure
the machine's load hardly changes) and the whole command's wall time; the table gives the median and the min/max
per checkout and run kind.

    .venv/bin/python -m bench.bench_first_request                       # this checkout, 5 repetitions
    .venv/bin/python -m bench.bench_first_request --checkout before=/tmp/fast-before --checkout after=. --reps 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.bench_cli import make_file
from bench.simulator_process import start_simulator_process

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"


class Forwarder:
    """A TCP forwarder (127.0.0.1:<port> -> the simulator) in a thread of its own that notes, per `arm()`, when the
    first request's first bytes and the first POST's arrive."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.arm()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def arm(self, pid: int | None = None) -> None:
        self.pid = pid  # the command's process: its CPU seconds are read when its first request arrives
        self.first: float | None = None
        self.first_post: float | None = None
        self.first_line = ""
        self.first_cpu: float | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pipe(r, w, note: bool):
            try:
                while data := await r.read(65536):
                    if note:
                        now = time.monotonic()
                        if self.first is None:
                            self.first = now
                            self.first_line = data.split(b"\r\n", 1)[0].decode("latin-1")[:80]
                            self.first_cpu = process_cpu_s(self.pid)
                        if self.first_post is None and data.startswith(b"POST "):
                            self.first_post = now
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                try:
                    w.close()
                except Exception:  # noqa: BLE001
                    pass

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` so far, every thread (Linux /proc; None elsewhere)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_once(checkout: Path, fwd: Forwarder, path: Path, out: Path, n: int, conc: int, rerun: bool, env: dict,
             timeout: float) -> dict:
    cmd = [sys.executable, "manage.py", "collect_rollouts", f"+input_jsonl_fpath={path}",
           f"+output_jsonl_fpath={out}", f"+model_base_url=http://127.0.0.1:{fwd.port}/v1", f"+model_name={MODEL}",
           f"+num_samples_in_parallel={conc}", "+responses_create_params.max_output_tokens=16", "+verifier=math"]
    if rerun:
        cmd.append("+resume=false")
    fwd.arm()
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fwd.pid = p.pid
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"{checkout}: collect_rollouts failed ({p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    nan = float("nan")
    return {"first": (fwd.first - t0) if fwd.first else nan,
            "first_post": (fwd.first_post - t0) if fwd.first_post else nan,
            "cpu_at_first": fwd.first_cpu if fwd.first_cpu is not None else nan,
            "wall": wall, "line": fwd.first_line, "load": os.getloadavg()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=[],
                    help="LABEL=DIR: a checkout whose manage.py to run (default: this one, labelled 'this')")
    ap.add_argument("-n", "--tasks", type=int, default=200)
    ap.add_argument("-c", "--concurrency", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runs", default="first,rerun")
    ap.add_argument("--db", default="", help="database URL (default: a fresh SQLite file per checkout)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--no-bytecode", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE from the environment (every module compiled at each start) "
                         "instead of letting the checkouts cache their bytecode as Python does by default")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    checkouts = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in args.checkout] or \
        [("this", REPO)]

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_first_") as tmp:
        tmp = Path(tmp)
        envs = {}
        for label, checkout in checkouts:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "CONTROLPLANE_VAR_DIR": str(tmp / f"var_{label}"),
                   "DATABASE_URL": args.db or f"sqlite:///{tmp}/{label}.sqlite3"}
            if not args.no_bytecode:  # as on a user's machine: modules load from their cached bytecode
                env.pop("PYTHONDONTWRITEBYTECODE", None)
            subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=checkout, env=env, check=True,
                           capture_output=True)
            envs[label] = env
        sim, sim_url = start_simulator_process("--model", MODEL, "--ttft-ms", 0, "--itl-ms", 0, "--jitter", 0,
                                               "--seed", 0, "--max-num-seqs", 4096, stderr=subprocess.DEVNULL)
        host, port = sim_url.split("//", 1)[1].rsplit(":", 1)
        fwd = Forwarder(host, int(port))
        for label, checkout in checkouts:  # untimed: writes the checkout's bytecode caches, like a first command
            path = tmp / f"warmup_{label}.jsonl"
            make_file(path, 20, 4999)
            run_once(checkout, fwd, path, tmp / f"warmup_{label}_out.jsonl", 20, 8, False, envs[label], args.timeout)
        print(f"{'rep':>3} {'checkout':>10} {'run':>5} {'1st req s':>9} {'1st POST s':>10} {'CPU s':>6} {'wall s':>7} "
              f"{'load':>5}  first request line", flush=True)
        try:
            for rep in range(args.reps):
                order = checkouts if rep % 2 == 0 else checkouts[::-1]
                for label, checkout in order:
                    path = tmp / f"tasks_{label}_{rep}.jsonl"
                    make_file(path, args.tasks, 5000 + rep)  # the same rows for every checkout, a new file each rep
                    for run in args.runs.split(","):
                        r = run_once(checkout, fwd, path, tmp / f"out_{label}_{rep}_{run}.jsonl", args.tasks,
                                     args.concurrency, run == "rerun", envs[label], args.timeout)
                        r.update(rep=rep, checkout=label, run=run)
                        results.append(r)
                        print(f"{rep:>3} {label:>10} {run:>5} {r['first']:9.3f} {r['first_post']:10.3f} "
                              f"{r['cpu_at_first']:6.2f} {r['wall']:7.2f} {r['load']:5.1f}  {r['line']}", flush=True)
        finally:
            sim.terminate()
            sim.wait(10)

    print(f"\nseconds from the command's start to its first request (median [min-max] of {args.reps}), "
          f"{args.tasks} tasks, parallelism {args.concurrency}")
    print(f"{'checkout':>10} {'run':>5} {'1st req s':>20} {'1st POST s':>20} {'CPU s at 1st req':>20} {'wall s':>7} "
          f"{'< 1 s':>5}")
    for label, _ in checkouts:
        for run in args.runs.split(","):
            rs = [r for r in results if r["checkout"] == label and r["run"] == run]
            f = [r["first"] for r in rs]
            fp = [r["first_post"] for r in rs]
            c = [r["cpu_at_first"] for r in rs]
            med = statistics.median(f)
            print(f"{label:>10} {run:>5} {med:6.3f} [{min(f):.3f}-{max(f):.3f}] "
                  f"{statistics.median(fp):6.3f} [{min(fp):.3f}-{max(fp):.3f}] "
                  f"{statistics.median(c):6.3f} [{min(c):.3f}-{max(c):.3f}] "
                  f"{statistics.median(r['wall'] for r in rs):7.2f} {'yes' if med < 1 else 'NO':>5}")
    print(f"load average at end: {'%.1f %.1f %.1f' % os.getloadavg()} (2 cores, shared)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
