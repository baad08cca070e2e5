"""NeMo Gym's own `ng_collect_rollouts` vs the product's agent job, side by side on ONE deployment.

One `ng_run` (scripts/nemo_gym.sh: math_with_judge's simple agent + the vllm_model server) in front of the
built-in simulator; the same N rows (default 500 rows x 1 repeat) collected at each
parallelism (default 16 and 64) by:

- `ng_collect_rollouts +agent_name=... +num_samples_in_parallel=P` (NeMo Gym 0.4.0, its own venv), and
- `manage.py collect_rollouts` with the same arguments (the drop-in: a job in the database, the
  product's engine sending every row to the agent's /run).

Each is a whole command run in a subprocess, as a user runs it: rollouts/s is rollouts written / wall time
of the command (start-up, input loading and output files included for both); client CPU is user+system
seconds of the command's process tree; client memory is its peak RSS (psutil every 0.1 s). "lost" counts
(task, repeat) pairs missing from or duplicated in the output. The deployment's own processes are not
the client and are not counted.

    .venv/bin/python -m bench.bench_nemo_gym                 # 500 rows at 16 and 64
    .venv/bin/python -m bench.bench_nemo_gym -n 100 -c 16    # a quick look
Needs PostgreSQL (DATABASE_URL; a database `<name>_bench_nemo_gym` is created and dropped) and a Python
>= 3.12 for nemo-gym (scripts/nemo_gym.sh setup builds .venv-nemo-gym).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
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
    """Peak RSS and CPU seconds of a process and its children, sampled every 0.1 s."""

    def __init__(self, pid: int):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.cpu: dict[int, float] = {}
        self.peak_rss = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.is_set():
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
            self.stop.wait(0.1)

    def finish(self):
        self.stop.set()
        self.thread.join()
        return sum(self.cpu.values()), self.peak_rss


def run_measured(cmd: list[str], env: dict, cwd: str) -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid)
    try:
        out, _ = proc.communicate(timeout=1800)
    except BaseException:  # interrupted or too slow: the client must not outlive the bench
        proc.kill()
        proc.wait()
        raise
    wall = time.monotonic() - t0
    cpu, rss = sampler.finish()
    return {"rc": proc.returncode, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss / 2**20, "log": out[-3000:]}


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
    head_port = free_port()
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
        for c in levels:
            common = [f"+agent_name={AGENT}", f"+input_jsonl_fpath={inp}", f"+num_repeats={repeats}",
                      f"+num_samples_in_parallel={c}", "+head_server.host=127.0.0.1", f"+head_server.port={head_port}",
                      "+responses_create_params.max_output_tokens=64"]
            for who in ("ng_collect_rollouts", "product agent job"):
                out = tmp / f"{'ng' if who.startswith('ng') else 'ours'}-{c}" / "rollouts.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                if who.startswith("ng"):
                    cmd = [str(ng_bin / "ng_collect_rollouts"), *common, f"+output_jsonl_fpath={out}"]
                    run_env = env
                else:
                    cmd = [sys.executable, "manage.py", "collect_rollouts", *common, f"+output_jsonl_fpath={out}"]
                    run_env = {**env, "DATABASE_URL": db_url}
                r = run_measured(cmd, run_env, str(out.parent) if who.startswith("ng") else str(REPO))
                ok, failed, lost = count(out, n_rows, repeats)
                if r["rc"] != 0:
                    print(f"{who} at {c} exited {r['rc']}:\n{r['log']}", file=sys.stderr)
                results.append({"who": who, "parallelism": c, "rollouts": ok, "failed": failed, "lost": lost,
                                "wall_s": r["wall_s"], "rollouts_per_s": ok / r["wall_s"], "cpu_s": r["cpu_s"],
                                "cpu_ms_per_rollout": 1000 * r["cpu_s"] / max(1, ok), "peak_rss_mb": r["peak_rss_mb"],
                                "rc": r["rc"]})
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env)
        sim.terminate()
        sim.wait(10)
        drop_database(db_url)

    print(f"\n{n_rows} rows x {repeats} repeats, one ng_run deployment (math_with_judge simple agent, vllm_model -> "
          f"simulator ttft {args.ttft_ms} ms, itl {args.itl_ms} ms); whole commands, wall time incl. start-up")
    head = f"{'client':<20}{'par':>5}{'ok':>6}{'failed':>8}{'lost':>6}{'wall s':>9}{'rollouts/s':>12}{'ratio':>7}" \
           f"{'CPU s':>8}{'CPU ms/roll':>12}{'peak RSS MB':>13}"
    print(head)
    print("-" * len(head))
    for r in results:
        ref = next(x for x in results if x["parallelism"] == r["parallelism"] and x["who"] == "ng_collect_rollouts")
        ratio = r["rollouts_per_s"] / ref["rollouts_per_s"] if ref["rollouts_per_s"] else float("nan")
        print(f"{r['who']:<20}{r['parallelism']:>5}{r['rollouts']:>6}{r['failed']:>8}{r['lost']:>6}{r['wall_s']:>9.1f}"
              f"{r['rollouts_per_s']:>12.2f}{ratio:>6.2f}x{r['cpu_s']:>8.1f}{r['cpu_ms_per_rollout']:>12.1f}"
              f"{r['peak_rss_mb']:>13.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
