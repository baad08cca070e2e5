"""The whole command, end to end: `manage.py collect_rollouts` vs the bare asyncio loop (issue 28).

Both sides are whole commands started by this bench as subprocesses, against ONE simulator server, interleaved
(bare, product, bare, product ... with the order flipped every other pair):
- bare: `python -m bench.bare_client --data FILE -n N -c P --verify` (one aiohttp session, P workers, math-verify
  in a warmed process pool, nothing stored);
- product: `python manage.py collect_rollouts +input_jsonl_fpath=FILE +output_jsonl_fpath=... +verifier=math`
  on the laptop default (a SQLite file, migrated before, not timed) or `--db postgres://...`; it loads the
  file as a dataset, stores every rollout and writes the NeMo Gym output files.
Cells: tasks x parallelism x latency (the simulator's time to first token, changed between cells through its
/admin/config) x run: "first" is a file the product has never seen (ingested in the command), "rerun" is the
same file again with +resume=false (the dataset is reused, a fresh job collects everything again).
Figures per run: wall seconds from the command's start to its exit, seconds from its start to the simulator's
first request ("to 1st req"), and per pair the ratio bare wall / product wall (>= 1.0: the product is as fast
end to end). The machine's load is printed with every run.

    .venv/bin/python -m bench.bench_cli                                  # the issue's 16 cells, 1 pair each
    .venv/bin/python -m bench.bench_cli -n 3000 -c 64 --latency-ms 0 --pairs 3

--arms A,B picks the two sides compared (default bare,product): `pN` is the product with +engine_processes=N,
e.g. `--arms p1,p2 --runs rerun` measures one engine process against two (the ratio is A's wall / B's); `sN` is
the product with +chunk_size=N. With two
product arms the pair's file is loaded as a dataset before the pair (untimed: a +limit=1 run), so both reuse it.

The commands run without PYTHONDONTWRITEBYTECODE (`--no-bytecode` keeps it), after one untimed product command:
the project's modules load from their cached bytecode, as on a user's machine from the second command on. Where it
is set (this sandbox sets it) every project module is compiled again at every start, a cost the bare loop (one
small file, the rest from site-packages, compiled by pip) does not pay.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.bench_collection import FirstRequest
from bench.simulator_process import start_simulator_process

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
MAX_TOKENS = 32


def make_file(path: Path, n: int, seed: int) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_math_dataset import make_rows

    with open(path, "w") as f:
        for row in make_rows(n, seed):
            f.write(json.dumps(row) + "\n")


def set_latency(sim_url: str, ms: float) -> None:
    req = urllib.request.Request(sim_url + "/admin/config", data=json.dumps({"ttft_ms": ms}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).read()


def timed(cmd: list[str], env: dict, sim_url: str, timeout: float) -> dict:
    first = FirstRequest(sim_url)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    try:
        t_first = first.stop() - t0
    except RuntimeError:
        t_first = float("nan")
    if p.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return {"wall": wall, "first": t_first, "out": p.stdout}


def bare_cmd(sim_url, path, n, conc) -> list[str]:
    return [sys.executable, "-m", "bench.bare_client", "--url", sim_url, "--model", MODEL, "--data", str(path),
            "-n", str(n), "-c", str(conc), "--max-tokens", str(MAX_TOKENS), "--verify", "--json"]


def product_cmd(sim_url, path, out, conc, rerun: bool, processes: int | None = None,
                chunk_size: int | None = None) -> list[str]:
    cmd = [sys.executable, "manage.py", "collect_rollouts", f"+input_jsonl_fpath={path}",
           f"+output_jsonl_fpath={out}", f"+model_base_url={sim_url}/v1", f"+model_name={MODEL}",
           f"+num_samples_in_parallel={conc}", f"+responses_create_params.max_output_tokens={MAX_TOKENS}",
           "+verifier=math"]
    if rerun:
        cmd.append("+resume=false")
    if processes is not None:
        cmd.append(f"+engine_processes={processes}")
    if chunk_size is not None:
        cmd.append(f"+chunk_size={chunk_size}")
    return cmd


def arm_cmd(arm, sim_url, path, out, n, conc, rerun: bool) -> list[str]:
    if arm == "bare":
        return bare_cmd(sim_url, path, n, conc)
    if arm == "product":
        return product_cmd(sim_url, path, out, conc, rerun)
    if arm[0] == "s":
        return product_cmd(sim_url, path, out, conc, rerun, chunk_size=int(arm[1:]))
    return product_cmd(sim_url, path, out, conc, rerun, int(arm[1:]))


def load() -> str:
    return "%.1f" % os.getloadavg()[0]


def main(argv=None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--tasks", type=ints, default=[3000, 30000])
    ap.add_argument("-c", "--concurrency", type=ints, default=[64, 256])
    ap.add_argument("--latency-ms", type=ints, default=[0, 200])
    ap.add_argument("--runs", default="first,rerun")
    ap.add_argument("--pairs", type=int, default=1, help="interleaved bare/product pairs per cell")
    ap.add_argument("--arms", default="bare,product", help="the two sides: bare, product, pN (the product with "
                    "+engine_processes=N) or sN (with +chunk_size=N); ratio = first's wall / second's")
    ap.add_argument("--db", default="", help="product database URL (default: a fresh SQLite file, the laptop default)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE from the environment (every project module compiled at each "
                         "start) instead of letting the commands cache their bytecode as Python does by default")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if len(arms) != 2 or not all(a in ("bare", "product") or (a[:1] in "ps" and a[1:].isdigit()) for a in arms):
        ap.error("--arms: two of bare, product, pN, sN")

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "DATABASE_URL": args.db or f"sqlite:///{tmp}/laptop.sqlite3",
               "PYTHONUNBUFFERED": "1"}
        if not args.no_bytecode:  # as on a user's machine: modules load from their cached bytecode
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True,
                       capture_output=True)
        sim, sim_url = start_simulator_process("--model", MODEL, "--ttft-ms", 0, "--itl-ms", 0, "--jitter", 0,
                                               "--seed", 0, "--max-num-seqs", 4096, stderr=subprocess.DEVNULL)
        warm = tmp / "warmup.jsonl"  # untimed: writes the bytecode caches, like a user's first command
        make_file(warm, 20, 999)
        subprocess.run(product_cmd(sim_url, warm, tmp / "warmup_out.jsonl", 8, False), cwd=REPO, env=env,
                       check=True, capture_output=True)
        seed = 1000
        print(f"{'tasks':>6} {'par':>4} {'lat ms':>6} {'run':>5} {'pair':>4} {'side':>7} {'wall s':>7} "
              f"{'to 1st req':>10} {'ratio':>6} {'load':>5}", flush=True)
        try:
            for n in args.tasks:
                for conc in args.concurrency:
                    for lat in args.latency_ms:
                        set_latency(sim_url, lat)
                        for pair in range(args.pairs):
                            seed += 1
                            path = tmp / f"tasks_{n}_{seed}.jsonl"
                            make_file(path, n, seed)
                            if "bare" not in arms:  # both arms reuse the dataset: load it before, untimed
                                subprocess.run(product_cmd(sim_url, path, tmp / f"prime_{seed}.jsonl", conc, True)
                                               + ["+limit=1"], cwd=REPO, env=env, check=True, capture_output=True)
                            for run in args.runs.split(","):
                                sides = list(arms) if pair % 2 == 0 else arms[::-1]
                                row = {"tasks": n, "par": conc, "latency_ms": lat, "run": run, "pair": pair}
                                for side in sides:
                                    out = tmp / f"out_{seed}_{run}_{side}.jsonl"
                                    cmd = arm_cmd(side, sim_url, path, out, n, conc, rerun=(run == "rerun"))
                                    row[side] = timed(cmd, env, sim_url, args.timeout)
                                    row[side]["load"] = load()
                                    if side == "bare":
                                        ok = json.loads(row[side].pop("out"))[0]["ok"]
                                    else:
                                        row[side].pop("out")
                                        ok = sum(1 for _ in open(out))
                                    row[side]["ok"] = ok
                                row["ratio"] = row[arms[0]]["wall"] / row[arms[1]]["wall"]
                                results.append(row)
                                for side in sides:
                                    r = row[side]
                                    print(f"{n:>6} {conc:>4} {lat:>6} {run:>5} {pair:>4} {side:>7} {r['wall']:7.2f} "
                                          f"{r['first']:10.2f} {row['ratio'] if side == arms[1] else 1:6.2f} "
                                          f"{r['load']:>5}  ok={r['ok']}", flush=True)
        finally:
            sim.terminate()
            sim.wait(10)

    a, b = arms
    print(f"\nper cell: median ratio {a} wall / {b} wall (>= 1.0 means {b} is as fast)")
    print(f"{'tasks':>6} {'par':>4} {'lat ms':>6} {'run':>5} {a + ' s':>9} {b + ' s':>9} {'ratio':>6} "
          f"{'1st req s (' + b + ')':>19} {'>= 1.0':>6}")
    cells: dict = {}
    for r in results:
        cells.setdefault((r["tasks"], r["par"], r["latency_ms"], r["run"]), []).append(r)
    for (n, conc, lat, run), rs in cells.items():
        ratio = statistics.median(r["ratio"] for r in rs)
        print(f"{n:>6} {conc:>4} {lat:>6} {run:>5} {statistics.median(r[a]['wall'] for r in rs):9.2f} "
              f"{statistics.median(r[b]['wall'] for r in rs):9.2f} {ratio:6.2f} "
              f"{statistics.median(r[b]['first'] for r in rs):19.2f} {'yes' if ratio >= 1.0 else 'NO':>6}")
    print(f"load average at end: {'%.1f %.1f %.1f' % os.getloadavg()} (2 cores, shared)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
