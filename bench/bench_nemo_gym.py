"""NeMo Gym's own `ng_collect_rollouts` vs the product's agent job, side by side on ONE deployment.

One `ng_run` (scripts/nemo_gym.sh: math_with_judge's simple agent + the vllm_model server) in front of the
built-in simulator; the same N rows (default 500 rows x 1 repeat) collected at each
parallelism (default 16 and 64) by:

- `ng_collect_rollouts +agent_name=... +num_samples_in_parallel=P` (NeMo Gym 0.4.0, its own venv), and
- `manage.py collect_rollouts` with the same arguments (the drop-in: a job in the database, the
  product's engine sending every row to the agent's /run).

Each is a whole command run in a subprocess, as a user runs it: rollouts/s is rollouts written / wall time
of the command (start-up, input loading and output files included for both); "collect s" is the time each
client reports itself: NeMo Gym's progress bar's window (so its wall - collect is start-up and output files),
the product's "This run: ... in X s", which counts from its command's start (so its wall - collect is the
output files alone). Client CPU is user+system seconds of the command's process
tree, and for the product also the PostgreSQL backends serving its database (shown again as "(DB)");
client memory is its peak RSS (psutil every 0.1 s). "deploy CPU ms/roll" is the CPU the deployment
(ng_run's process tree and the simulator) spent per rollout while that client ran: the same work per
rollout means the client does not make the servers work harder; "deploy cores" is that CPU over the
command's wall time, the share of the machine the deployment got (it sets the pace: a window where it got
less is a slower window whichever client ran). "load" is the machine's mean 1-minute load average during
the command. "lost" counts (task, repeat) pairs missing from or duplicated in the
output.

The deployment's Python servers set the pace on a small machine, and other work on the machine moves
wall times by tens of percent between back-to-back commands, so `--rounds R` repeats every parallelism R
times with the two clients' order alternating (ng first in even rounds, the product first in odd ones);
the summary gives each parallelism's median ratio over rounds, its spread, and the ratio of rollouts/s
pooled over all rounds.

    .venv/bin/python -m bench.bench_nemo_gym                 # 500 rows at 16 and 64, 1 round
    .venv/bin/python -m bench.bench_nemo_gym --rounds 3      # 3 alternating rounds, median ratios
    .venv/bin/python -m bench.bench_nemo_gym -n 100 -c 16    # a quick look
Needs PostgreSQL (DATABASE_URL; a database `<name>_bench_nemo_gym` is created and dropped) and a Python
>= 3.12 for nemo-gym (scripts/nemo_gym.sh setup builds .venv-nemo-gym).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.simulator_process import start_simulator_process

REPO = Path(__file__).resolve().parent.parent
AGENT = "math_with_judge_simple_agent"
SCRIPT = REPO / "scripts" / "nemo_gym.sh"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_simulator(ttft_ms: int, itl_ms: int):
    return start_simulator_process("--model", "sim", "--ttft-ms", ttft_ms, "--itl-ms", itl_ms, "--jitter", 0,
                                   "--seed", 0, "--math-accuracy", 0.7, "--max-num-seqs", 512, stderr=subprocess.DEVNULL)


def write_rows(path: Path, n: int):
    with open(path, "w") as f:
        for i in range(n):
            a, b = 3 * i + 1, 7 * i + 2
            f.write(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + {b}?"}]},
                                "question": f"What is {a} + {b}?", "expected_answer": str(a + b), "id": f"t{i}"}) + "\n")


class Sampler:
    """Peak RSS and CPU seconds of a process and its children, sampled every 0.1 s; with `db_name`, also the CPU
    of the PostgreSQL backends serving that database (found by process title every 2 s, read every 0.5 s): the product's client
    keeps its job in the database, and that work is the client's too."""

    def __init__(self, pid: int, db_name: str = ""):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.db_name = db_name
        self.cpu: dict[int, float] = {}
        self.db_cpu: dict[int, float] = {}
        self.db_procs: dict = {}
        self.peak_rss = 0
        self.loads: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _db_backends(self, rescan: bool):
        # finding the backends reads every process's title: done every 2 s only (this sampler's own CPU
        # would otherwise slow the machine during the product's runs alone); the known ones every 0.5 s
        if rescan:
            for p in self.psutil.process_iter(["cmdline"]):
                try:
                    title = " ".join(p.info["cmdline"] or [])
                    if title.startswith("postgres:") and f" {self.db_name} " in title:
                        self.db_procs.setdefault(p.pid, p)
                except self.psutil.Error:
                    pass
        for pid, p in list(self.db_procs.items()):
            try:
                t = p.cpu_times()
                self.db_cpu[pid] = t.user + t.system
            except self.psutil.Error:
                del self.db_procs[pid]

    def _loop(self):
        n = 0
        while not self.stop.is_set():
            if self.db_name and n % 5 == 0:
                self._db_backends(rescan=n % 20 == 0)
            n += 1
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except self.psutil.Error:
                break
            rss = 0
            for p in procs:
                try:
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system + t.children_user + t.children_system
                    rss += p.memory_info().rss
                except self.psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.loads.append(os.getloadavg()[0])
            self.stop.wait(0.1)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return (sum(self.cpu.values()), self.peak_rss, (statistics.fmean(self.loads) if self.loads else 0.0),
                sum(self.db_cpu.values()))


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user+system) of these processes, their reaped children and all their live descendants, as of now."""
    import psutil

    total = 0.0
    seen = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()  # with reaped children: a server may fork a process per call
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    return total


_TQDM_DONE = re.compile(r"Collecting rollouts: 100%[^\[]*\[(?:(\d+):)?(\d+):(\d+)<")
_OURS_DONE = re.compile(r"This run: \d+ rollouts in ([0-9.]+)s")


def collection_window_s(log: str) -> float | None:
    """The collection time the client reports itself (NeMo Gym's tqdm bar at 100 %, or the product's summary)."""
    m = _OURS_DONE.search(log)
    if m:
        return float(m.group(1))
    hits = _TQDM_DONE.findall(log)
    if hits:
        h, mnt, sec = hits[-1]
        return int(h or 0) * 3600 + int(mnt) * 60 + int(sec)
    return None


def run_measured(cmd: list[str], env: dict, cwd: str, db_name: str = "") -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid, db_name)
    try:
        out, _ = proc.communicate(timeout=1800)
    except BaseException:  # interrupted or too slow: the client must not outlive the bench
        proc.kill()
        proc.wait()
        raise
    wall = time.monotonic() - t0
    cpu, rss, load, db_cpu = sampler.finish()
    return {"rc": proc.returncode, "wall_s": wall, "cpu_s": cpu + db_cpu, "db_cpu_s": db_cpu,
            "peak_rss_mb": rss / 2**20, "load": load,
            "collect_s": collection_window_s(out), "log": out[-3000:]}


def warm_up(head: str, path: Path, n: int, parallelism: int) -> None:
    """Send n rows to the agent's /run, `parallelism` at a time, before anything is measured: the deployment's
    first requests (its servers' lazy imports, first connections) would otherwise slow whichever client runs
    first."""
    if n <= 0:
        return
    import requests
    from concurrent.futures import ThreadPoolExecutor

    from workers.nemo_gym.deployment import resolve_sync

    url = resolve_sync(head).agents[AGENT] + "/run"
    write_rows(path, n)
    rows = [json.loads(line) for line in path.read_text().splitlines()]

    def one(i_row):
        i, row = i_row
        body = {**row, "agent_ref": {"name": AGENT}, "_ng_task_index": i, "_ng_rollout_index": 0,
                "responses_create_params": {**row["responses_create_params"], "max_output_tokens": 64}}
        return requests.post(url, json=body, timeout=600).status_code

    t0 = time.monotonic()
    with ThreadPoolExecutor(min(parallelism, n)) as pool:
        codes = list(pool.map(one, enumerate(rows)))
    print(f"warm-up: {n} rows to {url} in {time.monotonic() - t0:.1f} s (HTTP {sorted(set(codes))})", file=sys.stderr)


def count(path: Path, n_rows: int, repeats: int) -> tuple[int, int, int]:
    """(ok rows, failed rows, lost pairs)"""
    ok = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    fpath = path.with_name(path.stem + "_failures.jsonl")
    failed = [json.loads(line) for line in fpath.read_text().splitlines() if line.strip()] if fpath.exists() else []
    pairs = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in ok + failed]
    lost = n_rows * repeats - len(set(pairs)) + (len(pairs) - len(set(pairs)))
    return len(ok), len(failed), lost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=500, help="rows per run (the issue's 500)")
    ap.add_argument("--repeats", type=int, default=1, help="num_repeats (rollouts = rows x repeats)")
    ap.add_argument("-c", default="16,64", help="parallelism levels")
    ap.add_argument("--ttft-ms", type=int, default=20)
    ap.add_argument("--itl-ms", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every parallelism this many times, the clients' "
                    "order alternating between rounds")
    ap.add_argument("--warmup", type=int, default=64, help="rows sent to the agent before anything is measured")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.c.split(",")]
    repeats = args.repeats
    n_rows = max(1, args.n)

    py = subprocess.run(["bash", str(SCRIPT), "python"], capture_output=True, text=True)
    if py.returncode != 0:
        raise SystemExit(py.stderr.strip())
    if subprocess.run(["bash", str(SCRIPT), "setup"]).returncode != 0:
        raise SystemExit("scripts/nemo_gym.sh setup failed")
    base_db = os.environ.get("DATABASE_URL", "")
    if not base_db.startswith("postgres"):
        raise SystemExit("bench_nemo_gym needs PostgreSQL: set DATABASE_URL=postgres://...")
    db_url = base_db.rsplit("/", 1)[0] + "/" + base_db.rsplit("/", 1)[1].split("?")[0] + "_bench_nemo_gym"
    from bench.bench_collection import create_database, drop_database

    tmp = Path(tempfile.mkdtemp(prefix="bench-nemo-gym-"))
    sim, sim_url = start_simulator(args.ttft_ms, args.itl_ms)
    head_port = int(os.environ.get("NEMO_GYM_HEAD_PORT") or free_port())
    ng_bin = REPO / ".venv-nemo-gym" / "bin"
    env = {**os.environ, "NEMO_GYM_RUN_DIR": str(tmp / "ng_run"), "NEMO_GYM_HEAD_PORT": str(head_port),
           "NEMO_GYM_MODEL": "sim", "UV_PYTHON_DOWNLOADS": "never",
           "PATH": f"{ng_bin}:{Path(py.stdout.strip()).parent}:{os.environ.get('PATH', '')}"}
    results = []
    try:
        create_database(db_url)
        started = subprocess.run(["bash", str(SCRIPT), "start", sim_url + "/v1"], env=env)
        if started.returncode != 0:
            raise SystemExit("ng_run did not start")
        inp = tmp / "rows.jsonl"
        write_rows(inp, n_rows)
        ng_pid = int((tmp / "ng_run" / "ng_run.pid").read_text().strip())
        warm_up(f"http://127.0.0.1:{head_port}", tmp / "warmup.jsonl", args.warmup, max(levels))
        for rnd in range(max(1, args.rounds)):
            for c in levels:
                common = [f"+agent_name={AGENT}", f"+input_jsonl_fpath={inp}", f"+num_repeats={repeats}",
                          f"+num_samples_in_parallel={c}", "+head_server.host=127.0.0.1",
                          f"+head_server.port={head_port}", "+responses_create_params.max_output_tokens=64"]
                arms = ("ng_collect_rollouts", "product agent job")
                for who in (arms if rnd % 2 == 0 else arms[::-1]):
                    ng = who.startswith("ng")
                    out = tmp / f"r{rnd}-{'ng' if ng else 'ours'}-{c}" / "rollouts.jsonl"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    if ng:
                        cmd = [str(ng_bin / "ng_collect_rollouts"), *common, f"+output_jsonl_fpath={out}"]
                        run_env = env
                    else:
                        cmd = [sys.executable, "manage.py", "collect_rollouts", *common, f"+output_jsonl_fpath={out}"]
                        run_env = {**env, "DATABASE_URL": db_url}
                    deploy0 = tree_cpu_s([ng_pid, sim.pid])
                    r = run_measured(cmd, run_env, str(out.parent) if ng else str(REPO),
                                     "" if ng else db_url.rsplit("/", 1)[1])
                    deploy_cpu = tree_cpu_s([ng_pid, sim.pid]) - deploy0
                    ok, failed, lost = count(out, n_rows, repeats)
                    if r["rc"] != 0:
                        print(f"{who} at {c} exited {r['rc']}:\n{r['log']}", file=sys.stderr)
                    results.append({"who": who, "round": rnd, "parallelism": c, "rollouts": ok, "failed": failed,
                                    "lost": lost, "wall_s": r["wall_s"], "collect_s": r["collect_s"],
                                    "rollouts_per_s": ok / r["wall_s"], "cpu_s": r["cpu_s"], "db_cpu_s": r["db_cpu_s"],
                                    "cpu_ms_per_rollout": 1000 * r["cpu_s"] / max(1, ok), "peak_rss_mb": r["peak_rss_mb"],
                                    "deploy_cpu_ms_per_rollout": 1000 * deploy_cpu / max(1, ok), "load": r["load"],
                                    "deploy_cores": deploy_cpu / r["wall_s"],
                                    "rc": r["rc"]})
                    print(f"round {rnd} {who} at {c}: {ok} ok, {failed} failed, {lost} lost, {r['wall_s']:.1f} s "
                          f"({ok / r['wall_s']:.2f}/s), load {r['load']:.1f}", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env)
        sim.terminate()
        sim.wait(10)
        drop_database(db_url)

    print(f"\n{n_rows} rows x {repeats} repeats, one ng_run deployment (math_with_judge simple agent, vllm_model -> "
          f"simulator ttft {args.ttft_ms} ms, itl {args.itl_ms} ms); whole commands, wall time incl. start-up")
    head = f"{'client':<20}{'rnd':>4}{'par':>5}{'ok':>6}{'failed':>8}{'lost':>6}{'wall s':>9}{'collect s':>10}" \
           f"{'rollouts/s':>12}{'ratio':>7}{'CPU s':>8}{'(DB)':>6}{'CPU ms/roll':>12}{'peak RSS MB':>13}{'deploy CPU ms/roll':>20}" \
           f"{'deploy cores':>14}{'load':>6}"
    print(head)
    print("-" * len(head))
    ratios: dict[int, list[float]] = {}
    for r in results:
        ref = next(x for x in results if x["parallelism"] == r["parallelism"] and x["round"] == r["round"]
                   and x["who"] == "ng_collect_rollouts")
        ratio = r["rollouts_per_s"] / ref["rollouts_per_s"] if ref["rollouts_per_s"] else float("nan")
        if r["who"] != "ng_collect_rollouts":
            ratios.setdefault(r["parallelism"], []).append(ratio)
        collect = f"{r['collect_s']:>10.1f}" if r["collect_s"] is not None else f"{'?':>10}"
        print(f"{r['who']:<20}{r['round']:>4}{r['parallelism']:>5}{r['rollouts']:>6}{r['failed']:>8}{r['lost']:>6}"
              f"{r['wall_s']:>9.1f}{collect}{r['rollouts_per_s']:>12.2f}{ratio:>6.2f}x{r['cpu_s']:>8.1f}{r['db_cpu_s']:>6.1f}"
              f"{r['cpu_ms_per_rollout']:>12.1f}{r['peak_rss_mb']:>13.0f}{r['deploy_cpu_ms_per_rollout']:>20.0f}"
              f"{r['deploy_cores']:>14.2f}{r['load']:>6.1f}")
    print(f"\nproduct / ng_collect_rollouts over {max(1, args.rounds)} round(s):")
    for c, rs in ratios.items():
        arms = {w: [x for x in results if x["parallelism"] == c and x["who"] == w]
                for w in ("ng_collect_rollouts", "product agent job")}
        pooled = {w: sum(x["rollouts"] for x in xs) / sum(x["wall_s"] for x in xs) for w, xs in arms.items()}
        lost = sum(x["lost"] for xs in arms.values() for x in xs)
        failed = sum(x["failed"] for xs in arms.values() for x in xs)
        print(f"  parallelism {c:>3}: median ratio {statistics.median(rs):.2f}x (per round "
              f"{', '.join(f'{x:.2f}' for x in rs)}; min {min(rs):.2f}, max {max(rs):.2f}); pooled rollouts/s "
              f"{pooled['product agent job']:.2f} vs {pooled['ng_collect_rollouts']:.2f} = "
              f"{pooled['product agent job'] / pooled['ng_collect_rollouts']:.2f}x; failed {failed}, lost {lost}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
