"""Collection throughput of the product vs the bare client, side by side (issue 3, "Must show").

One run starts the simulator at zero latency (`--ttft-ms 0 --itl-ms 0 --jitter 0`), a bench database
on PostgreSQL (created, migrated, dropped at the end), and ONE real Celery worker
(`celery -A controlplane worker -P threads -c 1` on a queue of its own), then, for each concurrency
(64 and 512) and each repetition, interleaved:

* bare     `bench.bare_client.run_bare`: the same math rows, the same max_tokens, the same verifier
           (`workers.verifiers.verify_row("math", ...)` in a warmed 2-process pool), no Celery, no
           database, no retries, no streaming;
* product  `controlplane.jobs.services.create_job(..., launch=True)`: a job over the same rows
           (limit = n, num_repeats = 1, num_samples_in_parallel = concurrency, max_output_tokens =
           max_tokens, verifier "math", default chunk size), dispatched through Redis to the worker,
           which streams every response (for TTFT), verifies in the engine's process pool, writes
           every rollout to PostgreSQL through DbSink, publishes progress to the Channels layer and
           polls the job row for control — everything a user's job does.

Throughput, identical for both: rollouts / (t_last - t_first), where t_first is the moment the
simulator first reports a request (running, waiting or finished in its /metrics, polled every 2 ms
by the bench until the first request shows up) and t_last is, for the bare client, the moment
run_bare returns (last answer verified) and, for the product, the moment the bench sees the job's
last rollout committed in PostgreSQL (the job's counters, bumped in the same transaction as the
rows, polled every 20 ms). The product's column "incl. start" also counts from the moment
create_job was called (Celery hop, lease, first page of rows read), and "job done" until the job's
state is completed (aggregate metrics written).

    .venv/bin/python -m bench.bench_collection                      # ~3-4 minutes on 2 cores
    .venv/bin/python -m bench.bench_collection -n 4000 -c 64,512 --reps 2 --json bench/results/coll.json
    .venv/bin/python -m bench.bench_collection --memory             # worker peak RSS, 10k vs 200k tasks

`--memory` runs one job of 10k tasks and one of 200k tasks (concurrency 512 by default), each in a
fresh worker, sampling the RSS of the worker and all its children (forkserver, verifier processes)
with psutil every 0.25 s.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.simulator_process import start_simulator_process  # noqa: E402

DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/bench_collection"
MODEL = "sim-model"


# ------------------------------------------------------------------------------------------------
# processes: simulator, database, Celery worker
# ------------------------------------------------------------------------------------------------
def start_simulator(max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    return start_simulator_process("--model", MODEL, "--ttft-ms", 0, "--itl-ms", 0, "--jitter", 0, "--seed", 0,
                                   "--max-num-seqs", max_num_seqs, stderr=subprocess.DEVNULL)


def create_database(url: str):
    import psycopg

    base, name = url.rsplit("/", 1)
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    env = dict(os.environ, DATABASE_URL=url)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)


def drop_database(url: str):
    import psycopg

    base, name = url.rsplit("/", 1)
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def setup_django(db_url: str, queue: str):
    os.environ["DATABASE_URL"] = db_url
    os.environ["CELERY_TASK_DEFAULT_QUEUE"] = queue  # create_job(launch=True) sends to our worker only
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()


@contextlib.contextmanager
def bench_database(url: str, queue: str, keep: bool = False):
    """A fresh, migrated bench database at `url`, Django set up on it and `queue`; dropped at the end unless `keep`."""
    create_database(url)
    setup_django(url, queue)
    try:
        yield
    finally:
        from django.db import connections

        connections.close_all()
        if not keep:
            drop_database(url)


def write_json(path: str | None, args, data: dict) -> None:
    """--json: the bench's arguments and results in one file."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"args": vars(args), **data}, indent=2, default=str))


class Worker:
    """`celery -A controlplane worker -P threads -c 1` on the bench queue and database."""

    def __init__(self, db_url: str, queue: str, log_dir: Path, tag: str, profile_dir: Path | None = None):
        self.profile_dir = profile_dir
        self.log_path = log_dir / f"worker-{tag}.log"
        self.log = open(self.log_path, "wb")
        env = {**os.environ, "DATABASE_URL": db_url, "CELERY_TASK_DEFAULT_QUEUE": queue, "PYTHONUNBUFFERED": "1",
               "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
        # profile_dir: the worker runs under yappi (bench/yappi_worker.py), its profile written there on stop
        # BENCH_SQL_TIMES=DIR: every SQL statement timed by shape (bench/sqltime_worker.py), written there on stop
        sql_dir = os.environ.get("BENCH_SQL_TIMES")
        # BENCH_TRACEMALLOC=DIR: the worker under tracemalloc, what grew written there on stop (bench/tracemalloc_worker.py)
        mem_dir = os.environ.get("BENCH_TRACEMALLOC")
        runner = (["bench.yappi_worker", str(profile_dir), tag] if profile_dir else
                  ["bench.sqltime_worker", sql_dir, tag] if sql_dir else
                  ["bench.tracemalloc_worker", mem_dir, tag] if mem_dir else ["celery"])
        args = [sys.executable, "-m", *runner, "-A", "controlplane", "worker", "-P", "threads", "-c", "1",
                "-Q", queue, "-n", f"bench-{tag}-{queue}@%h", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "info"]
        self.popen = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        deadline = time.monotonic() + 60
        while b" ready." not in self.log_path.read_bytes():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("celery worker did not start:\n" + self.tail())
            time.sleep(0.1)

    def tail(self, n=3000):
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self):
        import signal

        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(120 if self.profile_dir else 30)  # writing a profile takes a while
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
            except ProcessLookupError:
                pass
        self.log.close()


# ------------------------------------------------------------------------------------------------
# the first request, seen from the simulator
# ------------------------------------------------------------------------------------------------
class FirstRequest:
    """Polls the simulator's /metrics (in a thread, every 2 ms) until a request is running, waiting or
    finished that was not there when polling began; then stops. Resolution: a few milliseconds."""

    def __init__(self, sim_url: str):
        self.url = sim_url + "/metrics"
        self.baseline = self._read()[1]
        self.t: float | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _read(self) -> tuple[float, float]:
        """(running + waiting, finished requests) from the simulator's vLLM-style metrics."""
        with urllib.request.urlopen(self.url, timeout=5) as r:
            text = r.read().decode()
        active = finished = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting{")):
                active += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:request_success_total"):
                finished += float(line.rsplit(" ", 1)[1])
        return active, finished

    def _run(self):
        while not self._stop.is_set():
            try:
                active, finished = self._read()
            except OSError:
                active, finished = 0, self.baseline
            if active > 0 or finished > self.baseline:
                self.t = time.monotonic()
                return
            time.sleep(0.002)

    def stop(self) -> float:
        self._stop.set()
        self.thread.join(5)
        if self.t is None:
            raise RuntimeError("the simulator never saw a request")
        return self.t


# ------------------------------------------------------------------------------------------------
# CPU seconds used by a process tree (the client side of a run), by the simulator and by PostgreSQL
# ------------------------------------------------------------------------------------------------
class CpuMeter:
    def __init__(self, client_pid: int, sim_pid: int, exclude=()):
        import psutil

        self.psutil = psutil
        self.client = psutil.Process(client_pid)
        self.sim = psutil.Process(sim_pid)
        self.exclude = set(exclude)  # child trees that are not this client's (the simulator, the worker)

    def _procs(self, proc):
        out = [proc]
        for child in proc.children():
            if child.pid not in self.exclude:
                out.extend(self._procs(child))
        return out

    def _cpu(self, procs) -> dict:
        """{pid: user + system CPU seconds} of the processes still there."""
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except self.psutil.Error:
                pass
        return out

    def _tree(self, proc) -> dict:
        return self._cpu(self._procs(proc))

    def _postgres(self) -> dict:
        return self._cpu(p for p in self.psutil.process_iter(["name"])
                         if p.info["name"] and p.info["name"].startswith("postgres"))

    def snapshot(self):
        return self._tree(self.client), self._tree(self.sim), self._postgres()

    def delta(self, a, b) -> dict:
        names = ("client", "simulator", "postgres")
        out = {name: sum(v - x.get(pid, 0.0) for pid, v in y.items()) for name, x, y in zip(names, a, b)}
        out["client_main"] = b[0].get(self.client.pid, 0.0) - a[0].get(self.client.pid, 0.0)
        return out


def run_bare_once(sim_url, rows, n, conc, max_tokens, pool, meter) -> dict:
    from bench.bare_client import run_bare

    cpu0 = meter.snapshot()
    first = FirstRequest(sim_url)
    r = asyncio.run(run_bare(sim_url, MODEL, rows, conc, max_tokens, verify=True, n=n, verifier="math",
                             verify_pool=pool))
    t_end = time.monotonic()
    t_first = first.stop()
    cpu = meter.delta(cpu0, meter.snapshot())
    secs = t_end - t_first
    return {"cpu": cpu, "side": "bare", "concurrency": conc, "n": n, "ok": r["ok"], "failed": n - r["ok"], "secs": secs,
            "rps": n / secs, "mean_reward": r.get("mean_reward"), "errors": r["errors"]}


def run_product_once(user, dataset, endpoint, n, conc, max_tokens, chunk_size, meter, timeout=900) -> dict:
    from django.db import connection

    from controlplane.jobs import services
    from controlplane.jobs.models import CollectionJob, JobState, Rollout

    cpu0 = meter.snapshot()
    first = FirstRequest(endpoint.base_url)
    t_dispatch = time.monotonic()
    job = services.create_job(owner=user, dataset=dataset, endpoint=endpoint, limit=n, num_repeats=1,
                              num_samples_in_parallel=conc, responses_create_params={"max_output_tokens": max_tokens},
                              verifier="math", chunk_size=chunk_size, name=f"bench c={conc}", launch=True)
    deadline = t_dispatch + timeout
    # The sink bumps the job's counters in the same transaction as each batch of rows, so counters == n
    # means the last row is committed. A primary-key read every 20 ms (a count(*) over the job's rows
    # would charge the bench's own polling to the product side).
    table = CollectionJob._meta.db_table
    t_stored = None
    with connection.cursor() as cur:
        while True:
            cur.execute(f"SELECT completed_count + failed_count, state, error_message FROM {table} WHERE id = %s",
                        [job.pk])
            stored, state, error = cur.fetchone()
            if stored >= n:
                t_stored = time.monotonic()
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job.pk} did not store {n} rollouts in {timeout}s")
            if state in (JobState.FAILED, JobState.CANCELLED):
                raise SystemExit(f"job {job.pk} {state}: {error}")
            time.sleep(0.02)
    t_first = first.stop()
    while True:
        job.refresh_from_db()
        if job.state not in (JobState.QUEUED, JobState.RUNNING):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job.pk} did not complete")
        time.sleep(0.05)
    t_done = time.monotonic()
    cpu = meter.delta(cpu0, meter.snapshot())
    secs = t_stored - t_first
    from django.db.models import Avg, Count

    agg = Rollout.objects.filter(job=job, status="ok").aggregate(
        ok=Count("id"), reward=Avg("reward"), queue_ms=Avg("queue_ms"), ttft_ms=Avg("ttft_ms"),
        verify_ms=Avg("verify_ms"), wall_ms=Avg("wall_ms"))
    ok = agg["ok"]
    return {"cpu": cpu, "side": "product", "concurrency": conc, "n": n, "ok": ok, "failed": n - ok, "secs": secs,
            "rps": n / secs, "rps_incl_start": n / (t_stored - t_dispatch), "rps_job_done": n / (t_done - t_first),
            "start_s": t_first - t_dispatch, "mean_reward": agg["reward"],
            "timings_ms": {k: agg[k] for k in ("queue_ms", "ttft_ms", "verify_ms", "wall_ms")},
            "state": job.state, "job_id": job.pk, "chunks": job.chunks.count()}


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def print_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))


def throughput_tables(results, concs):
    print("\nruns, in the order they ran:")
    rows = []
    for r in results:
        rows.append([r["rep"], r["concurrency"], r["side"], r["n"], r["ok"], f"{r['secs']:.2f}", f"{r['rps']:.0f}",
                     f"{r['rps_incl_start']:.0f}" if "rps_incl_start" in r else "-",
                     f"{r['rps_job_done']:.0f}" if "rps_job_done" in r else "-",
                     f"{r['mean_reward']:.3f}" if r.get("mean_reward") is not None else "-",
                     *(f"{r['cpu'][k] * 1000 / r['n']:.2f}" for k in ("client", "client_main", "simulator", "postgres")),
                     " ".join(f"{v:.0f}" for v in r["timings_ms"].values()) if "timings_ms" in r else "-"])
    print_table(["rep", "conc", "side", "n", "ok", "secs", "rollouts/s", "incl. start", "job done", "reward",
                 "client cpu-ms/rollout", "main proc", "sim cpu-ms", "postgres cpu-ms",
                 "queue/ttft/verify/wall ms"], rows)

    print("\nside by side (one Celery worker -> PostgreSQL vs bare client; same rows, max_tokens, verifier):")
    rows = []
    summary = {}
    for c in concs:
        bare = [r for r in results if r["concurrency"] == c and r["side"] == "bare"]
        prod = [r for r in results if r["concurrency"] == c and r["side"] == "product"]
        ratios = [p["rps"] / b["rps"] for b, p in zip(bare, prod)]
        b_med = statistics.median(r["rps"] for r in bare)
        p_med = statistics.median(r["rps"] for r in prod)
        ratio = statistics.median(ratios)
        summary[c] = {"bare_rps": b_med, "product_rps": p_med, "ratio": ratio, "ratios": ratios}
        rows.append([c, len(bare), f"{b_med:.0f}", f"{p_med:.0f}",
                     f"{statistics.median(r['rps_incl_start'] for r in prod):.0f}",
                     " ".join(f"{x:.2f}" for x in ratios), f"{ratio:.2f}", "yes" if ratio >= 0.8 else "NO"])
    print_table(["conc", "pairs", "bare rollouts/s", "product rollouts/s", "product incl. start",
                 "ratio per pair", "ratio (median)", ">= 0.8"], rows)
    print("""
rollouts/s = rollouts / (t_last - t_first), the same clock (the bench's monotonic) for both:
  t_first = the simulator first reports a request (its /metrics polled every 2 ms);
  t_last  = bare: run_bare returned (last answer verified);
            product: the job's last rollout is committed in PostgreSQL (the job's counters, which the
            sink bumps in the same transaction as the rows, polled every 20 ms).
cpu-ms/rollout: CPU time used during the run (psutil) / rollouts; client = the bench process and its
verifier pool (bare) or the Celery worker and all its children (product); postgres = every postgres
process on the machine (other people's queries included: noisy); main proc = the client's own process
(without its verifier processes). queue/ttft/verify/wall ms: the product's mean per-rollout timings.
ratio per pair = product / bare of the two runs made back to back; "incl. start" counts the product
from create_job() (Celery hop, lease, first page of rows); "job done" until the job is completed.""")
    return summary


# ------------------------------------------------------------------------------------------------
# modes
# ------------------------------------------------------------------------------------------------
def make_dataset(user, n: int, tmp: Path):
    spec = __import__("importlib.util").util.spec_from_file_location("make_math_dataset",
                                                                       REPO / "scripts" / "make_math_dataset.py")
    mod = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp / f"math-{n}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in mod.make_rows(n, 0):
            f.write(json.dumps(row) + "\n")
    from controlplane.datasets.services import ingest_jsonl

    return path, ingest_jsonl(str(path), name=f"bench math {n}", owner=user, source_filename=path.name)


def fixtures(sim_url):
    from django.contrib.auth import get_user_model

    from controlplane.endpoints.models import Endpoint

    user, _ = get_user_model().objects.get_or_create(username="bench-collection")
    ep = Endpoint.objects.create(owner=user, name="bench simulator", base_url=sim_url, model_name=MODEL,
                                 request_timeout_s=120.0)
    return user, ep


def throughput_mode(args, tmp: Path, sim_url: str, sim_pid: int, queue: str):
    from bench.bare_client import load_rows, make_verify_pool
    user, ep = fixtures(sim_url)
    path, dataset = make_dataset(user, args.n, tmp)
    rows = load_rows(str(path))
    pool = make_verify_pool(max(1, os.cpu_count() or 1), "math")  # the engine's default pool size: one per core
    worker = Worker(os.environ["DATABASE_URL"], queue, tmp, "throughput")
    bare_meter = CpuMeter(os.getpid(), sim_pid, exclude=(sim_pid, worker.popen.pid))
    product_meter = CpuMeter(worker.popen.pid, sim_pid)
    results = []
    try:
        # warm-up, both sides, not measured: imports, connections, the worker's verifier pool
        run_bare_once(sim_url, rows, min(500, args.n), 64, args.max_tokens, pool, bare_meter)
        r = run_product_once(user, dataset, ep, min(500, args.n), 64, args.max_tokens, args.chunk_size, product_meter)
        print(f"  warm-up job (the worker's first, verifier pool cold): {r['rps']:.0f} rollouts/s from the first "
              f"request, first request {r['start_s']:.2f}s after create_job", flush=True)
        for rep in range(1, args.reps + 1):
            for c in args.concurrency:
                for side in ("bare", "product"):
                    if side == "bare":
                        r = run_bare_once(sim_url, rows, args.n, c, args.max_tokens, pool, bare_meter)
                    else:
                        spy = None
                        if args.profile:
                            out = Path(args.profile) / f"worker-c{c}-rep{rep}.txt"
                            out.parent.mkdir(parents=True, exist_ok=True)
                            spy = subprocess.Popen([args.py_spy, "record", "-p", str(worker.popen.pid), "-r", "100",
                                                    "-f", "raw", "-o", str(out)], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL)
                        r = run_product_once(user, dataset, ep, args.n, c, args.max_tokens, args.chunk_size,
                                             product_meter)
                        if spy is not None:
                            import signal

                            spy.send_signal(signal.SIGINT)
                            spy.wait(30)
                    r["rep"] = rep
                    results.append(r)
                    print(f"  rep {rep} c={c:<4} {side:<8} {r['rps']:7.0f} rollouts/s  ({r['secs']:.2f}s, ok {r['ok']}/{r['n']})",
                          flush=True)
    finally:
        worker.stop()
        pool.shutdown(wait=True, cancel_futures=True)
    summary = throughput_tables(results, args.concurrency)
    return {"results": results, "summary": {str(k): v for k, v in summary.items()}}


def memory_mode(args, tmp: Path, sim_url: str, queue: str):
    import psutil

    from controlplane.jobs import services
    from controlplane.jobs.models import JobState

    user, ep = fixtures(sim_url)
    sizes = args.memory_sizes
    t = time.monotonic()
    _, dataset = make_dataset(user, max(sizes), tmp)
    print(f"  dataset of {max(sizes)} rows ingested in {time.monotonic() - t:.0f}s", flush=True)
    out = []
    for n in sizes:
        worker = Worker(os.environ["DATABASE_URL"], queue, tmp, f"mem-{n}")
        try:
            proc = psutil.Process(worker.popen.pid)

            def sample():
                procs = [proc] + proc.children(recursive=True)  # noqa: B023
                main = total = 0
                for p in procs:
                    try:
                        rss = p.memory_info().rss
                    except psutil.Error:
                        continue
                    total += rss
                    if p.pid == proc.pid:  # noqa: B023
                        main = rss
                return main, total, len(procs)

            idle_main, idle_total, _ = sample()
            peak_main = peak_total = 0
            nprocs = 0
            t0 = time.monotonic()
            job = services.create_job(owner=user, dataset=dataset, endpoint=ep, limit=n, num_repeats=1,
                                      num_samples_in_parallel=args.memory_concurrency,
                                      responses_create_params={"max_output_tokens": args.max_tokens},
                                      verifier="math", chunk_size=args.chunk_size, name=f"memory {n}", launch=True)
            series = []
            timeline = []  # (s, worker MB, worker+children MB, rollouts stored): in the --json output
            while True:
                main, total, k = sample()
                peak_main, peak_total, nprocs = max(peak_main, main), max(peak_total, total), max(nprocs, k)
                series.append(main)
                timeline.append((round(time.monotonic() - t0, 2), round(main / 2**20, 1), round(total / 2**20, 1),
                                 job.completed_count + job.failed_count))
                job.refresh_from_db(fields=["state", "completed_count", "failed_count", "error_message"])
                if job.state not in (JobState.QUEUED, JobState.RUNNING):
                    break
                if time.monotonic() - t0 > args.memory_timeout:
                    raise SystemExit(f"memory job of {n} did not finish in {args.memory_timeout}s")
                time.sleep(0.25)
            secs = time.monotonic() - t0
            mb = 1 / (1024 * 1024)
            collecting = [m for _, m, _, stored in timeline if stored < n] or [0.0]
            r = {"peak_collect_mb": max(collecting), "tasks": n, "state": job.state, "stored": job.completed_count + job.failed_count,
                 "secs": secs, "rps": n / secs, "idle_main_mb": idle_main * mb, "peak_main_mb": peak_main * mb,
                 "peak_total_mb": peak_total * mb, "processes": nprocs,
                 "main_mb_at_10pct": series[len(series) // 10] * mb, "main_mb_at_end": series[-1] * mb,
                 "timeline": timeline}
            out.append(r)
            print(f"  {n} tasks: {job.state}, {r['stored']} stored in {secs:.0f}s, worker peak RSS "
                  f"{r['peak_main_mb']:.0f} MB (+children {r['peak_total_mb']:.0f} MB)", flush=True)
        finally:
            worker.stop()
    print(f"\nworker memory (one Celery worker -P threads -c 1, concurrency {args.memory_concurrency}, "
          f"chunk size {args.chunk_size}):")
    print_table(["tasks", "state", "stored", "secs", "rollouts/s", "idle MB", "worker MB @10%",
                 "peak worker MB collecting", "peak worker MB incl. finalize", "worker MB @end",
                 "peak worker+children MB", "processes"],
                [[r["tasks"], r["state"], r["stored"], f"{r['secs']:.0f}", f"{r['rps']:.0f}", f"{r['idle_main_mb']:.0f}",
                  f"{r['main_mb_at_10pct']:.0f}", f"{r['peak_collect_mb']:.0f}", f"{r['peak_main_mb']:.0f}",
                  f"{r['main_mb_at_end']:.0f}", f"{r['peak_total_mb']:.0f}", r["processes"]] for r in out])
    print("RSS from psutil every 0.25 s: 'worker' is the Celery worker process; children are the forkserver "
          "and the verifier processes (shared pages counted once per process).\n'collecting': samples taken "
          "before the job's last rollout was stored; 'incl. finalize' adds the job's finalization "
          "(services.finalize_job: aggregate metrics over all its rows).")
    if len(out) >= 2:
        print(f"peak worker RSS {out[-1]['tasks']} vs {out[0]['tasks']} tasks: collecting "
              f"{out[-1]['peak_collect_mb'] / out[0]['peak_collect_mb']:.2f}x, incl. finalize "
              f"{out[-1]['peak_main_mb'] / out[0]['peak_main_mb']:.2f}x")
    return {"memory": out}


def main(argv=None) -> int:
    def ints(text):
        return [int(x) for x in text.split(",") if x.strip()]

    p = argparse.ArgumentParser(prog="python -m bench.bench_collection",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=6000, help="rollouts per run (default 6000)")
    p.add_argument("-c", "--concurrency", type=ints, default=[64, 512], help="comma-separated (default 64,512)")
    p.add_argument("--reps", type=int, default=2, help="interleaved bare/product pairs per concurrency (default 2)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--chunk-size", type=int, default=5000, help="job chunk size (default 5000, the product's default)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"bench database URL, created and dropped (default {DEFAULT_DB})")
    p.add_argument("--keep-db", action="store_true", help="do not drop the bench database at the end")
    p.add_argument("--memory", action="store_true", help="measure the worker's peak RSS instead (10k vs 200k tasks)")
    p.add_argument("--memory-sizes", type=ints, default=[10_000, 200_000])
    p.add_argument("--memory-concurrency", type=int, default=512)
    p.add_argument("--memory-timeout", type=float, default=1800)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record the worker (and its children) with py-spy during each product run (raw stacks in DIR)")
    p.add_argument("--py-spy", default="py-spy", help="py-spy executable for --profile")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    queue = f"bench-collection-{uuid.uuid4().hex[:8]}"
    with bench_database(args.db, queue, keep=args.keep_db):
        sim, sim_url = start_simulator(max_num_seqs=max(1024, *args.concurrency, args.memory_concurrency))
        print(f"simulator {sim_url} (zero latency), database {args.db.rsplit('/', 1)[1]}, queue {queue}, "
              f"{os.cpu_count()} CPUs", flush=True)
        try:
            with tempfile.TemporaryDirectory(prefix="bench-collection-") as tmp:
                if args.memory:
                    data = memory_mode(args, Path(tmp), sim_url, queue)
                else:
                    print(f"{args.n} rollouts per run, max_tokens {args.max_tokens}, concurrency "
                          f"{','.join(map(str, args.concurrency))}, {args.reps} interleaved pairs each", flush=True)
                    data = throughput_mode(args, Path(tmp), sim_url, sim.pid, queue)
        finally:
            sim.terminate()
            sim.wait(10)
    write_json(args.json, args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
