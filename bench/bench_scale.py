"""Scale (issue 16, "Must show"): one job on 1, 2, 4 Celery worker processes, and 16,384 requests in flight.

workers   One job of N rollouts (default 100,000; also 10,000 to show memory flat across dataset sizes) on
          the simulator at 200 ms latency (`--ttft-ms 200 --itl-ms 0 --jitter 0`), run by 1, 2 and 4 real
          Celery worker processes (`celery -A controlplane worker -P threads -c 1`, each on the bench queue)
          writing into PostgreSQL, with the job's total parallelism fixed (default 512: the bound is
          512 / 0.2 s = 2,560 rollouts/s). Per run: rollouts/s from the first stored rows seen (not counted) to the last stored rollout,
          the peak RSS of each worker process (its own, and with its verifier children), the rows stored
          and the duplicates (must be 0: the unique constraint and the lease), and the CPU per rollout of
          the workers, their verifier processes, the simulator and PostgreSQL (where the cores went).
          --chunk-size 100 shows the per-chunk cost; --profile DIR runs each worker under yappi.
inflight  The engine (workers.engine.run_collection, in this process, a counting sink: no database) with
          parallelism 16,384 against the simulator at 10 s latency (`--ttft-ms 10000 --itl-ms 0`,
          max_num_seqs and KV cache big enough that the simulator never queues): achieved rollouts/s over
          the bound 16,384 / 10 s = 1,638/s, peak RSS of the engine and of the simulator, errors by class,
          the open-file limit. Goal: >= 0.9 of the bound, 0 errors. The rate is given over the whole run (the
          ramp of opening 16,384 connections included) and sustained (once every request is in flight).

    .venv/bin/python -m bench.bench_scale                    # both parts, full size
    .venv/bin/python -m bench.bench_scale workers --sizes 2000,10000 --workers 1,2
    .venv/bin/python -m bench.bench_scale workers --sizes 3000 --workers 1 --chunk-size 100 --profile /tmp/prof
    .venv/bin/python -m bench.bench_scale inflight --inflight 4096 --latency-s 5

On one shared 2-core machine the worker processes compete for the same cores as the simulator and
PostgreSQL, so more workers help only as far as CPU is free; on separate hosts each brings its own.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from bench.bench_collection import MODEL, Worker, bench_database, fixtures, make_dataset, print_table, write_json
from bench.simulator_process import start_simulator_process

DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/bench_scale"
MB = 1 / 2**20


def start_simulator(ttft_ms: float, max_num_seqs: int, loop: str = "asyncio") -> tuple[subprocess.Popen, str]:
    return start_simulator_process(
        "--model", MODEL, "--ttft-ms", ttft_ms, "--itl-ms", 0, "--jitter", 0, "--seed", 0, "--max-num-seqs", max_num_seqs,
        "--max-queue", max_num_seqs * 4, "--kv-cache-tokens", max_num_seqs * 512, "--max-model-len", 4096,
        stderr=subprocess.DEVNULL, preexec_fn=_raise_nofile, env={**os.environ, "SIM_EVENT_LOOP": loop})


def _raise_nofile():
    from workers.engine.fdlimit import raise_open_file_limit

    raise_open_file_limit()


def sched_ns(proc: psutil.Process) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of a process, all its threads summed (/proc/PID/task/TID/
    schedstat; (0, 0) where the kernel has no schedstats). The wait is the time other processes held the cores:
    on a shared machine it tells contention from a slower pipeline, whose idle waits are in neither."""
    run = wait = 0
    try:
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                    r, w, _ = f.read().split()
                run, wait = run + int(r), wait + int(w)
            except (OSError, ValueError):
                pass
    except OSError:
        pass
    return run, wait


class RssSampler(threading.Thread):
    """Peak RSS of some processes (and optionally their children), every `interval` seconds; their CPU and
    run-queue wait (sched_ns) at the last sample."""

    def __init__(self, pids, children=True, interval=0.25):
        super().__init__(daemon=True)
        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.children, self.interval = children, interval
        self.peak_own = collections.defaultdict(int)
        self.peak_total = collections.defaultdict(int)
        self.cpu_own = collections.defaultdict(float)  # user + system CPU seconds at the last sample
        self.cpu_children: dict[int, dict[int, float]] = collections.defaultdict(dict)  # pid -> child pid -> CPU s
        self.wait_ns: dict[int, int] = {}  # pid or child pid -> run-queue wait (ns) at the last sample
        self.stop = threading.Event()

    def sample(self):
        for pid, proc in self.procs.items():
            try:
                own = proc.memory_info().rss
                self.cpu_own[pid] = sum(proc.cpu_times()[:2])
                self.wait_ns[pid] = sched_ns(proc)[1]
                total = own
                if self.children:
                    for c in proc.children(recursive=True):
                        try:
                            total += c.memory_info().rss
                            self.cpu_children[pid][c.pid] = sum(c.cpu_times()[:2])
                            self.wait_ns[c.pid] = sched_ns(c)[1]
                        except psutil.Error:
                            pass
            except psutil.Error:
                continue
            self.peak_own[pid] = max(self.peak_own[pid], own)
            self.peak_total[pid] = max(self.peak_total[pid], total)

    def run(self):
        while not self.stop.wait(self.interval):
            self.sample()


# ------------------------------------------------------------------------------------------------
# workers: one job, 1 / 2 / 4 worker processes
# ------------------------------------------------------------------------------------------------
def _cpu_s(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (every core; /proc/stat, less idle and iowait)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class PostgresCpu:
    """CPU seconds of the PostgreSQL server: its live processes, plus what the postmaster's exited children
    (the backends of connections closed meanwhile: a chunk run closes its own) used, from the postmaster's
    children times. The server is shared: other clients' queries count too."""

    def __init__(self):
        self.live0, self.reaped0 = self._read()

    @staticmethod
    def _read() -> tuple[dict[int, float], float]:
        live, reaped = {}, 0.0
        for p in psutil.process_iter(["name", "ppid"]):
            if not (p.info["name"] or "").startswith("postgres"):
                continue
            try:
                t = p.cpu_times()
                live[p.pid] = t.user + t.system
                if p.info["ppid"] == 1 or not (psutil.Process(p.info["ppid"]).name() or "").startswith("postgres"):
                    reaped += t.children_user + t.children_system  # the postmaster
            except psutil.Error:
                pass
        return live, reaped

    def used_s(self) -> float:
        live, reaped = self._read()
        # a backend gone since the start: its whole CPU is in `reaped`, less what it had used by then
        gone = sum(v for pid, v in self.live0.items() if pid not in live)
        return sum(v - self.live0.get(pid, 0.0) for pid, v in live.items()) + (reaped - self.reaped0) - gone


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def run_job_on_workers(args, user, dataset, ep, n, n_workers, tmp: Path, queue: str, sim_pid: int) -> dict:
    from django.db.models import Count

    from controlplane.jobs import services
    from controlplane.jobs.models import JobChunk, JobState, Rollout

    profile_dir = Path(args.profile) if args.profile else None
    workers = [Worker(os.environ["DATABASE_URL"], queue, tmp, f"w{n_workers}-{i}-{n}", profile_dir)
               for i in range(n_workers)]
    sampler = RssSampler([w.popen.pid for w in workers])
    sampler.sample()
    cpu0 = sum(sampler.cpu_own.values())  # the workers' start-up is not the job's
    wait0 = sum(sampler.wait_ns.values())
    sim, pg = psutil.Process(sim_pid), PostgresCpu()
    sim0, sim_wait0, machine0 = _cpu_s([sim]), sched_ns(sim)[1], _machine_busy_s()
    sampler.start()
    try:
        t0 = time.monotonic()
        chunk_size = args.chunk_size or max(500, n // (4 * max(args.workers)))
        job = services.create_job(owner=user, dataset=dataset, endpoint=ep, limit=n, num_repeats=1,
                                  num_samples_in_parallel=args.parallelism, verifier=args.verifier,
                                  responses_create_params={"max_output_tokens": args.max_tokens},
                                  chunk_size=chunk_size, name=f"scale {n} x {n_workers}", launch=True)
        t_first = t_last = rss_early = rss_collecting = None
        stored_first = 0  # the rows already stored when the first were seen: stored before t_first, not after it
        timeline, next_mark = [], 1  # (% of the job stored, s since the first row, RSS of the largest worker now MB)
        while True:
            job.refresh_from_db(fields=["state", "completed_count", "failed_count", "error_message"])
            stored = job.completed_count + job.failed_count
            now = time.monotonic()
            if stored and t_first is None:
                t_first, stored_first = now, stored
            if stored >= n and t_last is None:
                t_last = now
                rss_collecting = max(sampler.peak_own.values(), default=0) * MB  # before the job's finalization
            if rss_early is None and stored >= n // 10:
                rss_early = max(sampler.peak_own.values(), default=0) * MB
            while next_mark <= 10 and stored >= n * next_mark // 10:  # RSS now (not the peak) at each 10 %
                timeline.append((next_mark * 10, round(now - (t_first or t0)), round(max(
                    (_rss(w.popen.pid) for w in workers), default=0) * MB)))
                next_mark += 1
                if n >= 100_000:  # a long run says how it goes (a run cut short still gives its figures)
                    print(f"    {n}: {timeline[-1][0]}% stored, {(stored - stored_first) / max(1e-9, now - (t_first or t0)):.0f} "
                          f"rollouts/s so far, worker RSS {timeline[-1][2]} MB, load average "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
            if job.state not in (JobState.QUEUED, JobState.RUNNING):
                break
            if now - t0 > args.timeout:
                raise SystemExit(f"job of {n} on {n_workers} workers did not finish in {args.timeout}s")
            time.sleep(0.1)
        t_last = t_last or time.monotonic()
    finally:
        sampler.stop.set()
        sampler.join()
        sampler.sample()
        sim_cpu, pg_cpu = _cpu_s([sim]) - sim0, pg.used_s()
        sim_wait, machine_s = sched_ns(sim)[1] - sim_wait0, _machine_busy_s() - machine0
        for w in workers:
            w.stop()
    cpu_workers = sum(sampler.cpu_own.values()) - cpu0
    cpu_verifiers = sum(sum(c.values()) for c in sampler.cpu_children.values())
    wait_s = (sum(sampler.wait_ns.values()) - wait0 + sim_wait) / 1e9
    job_wall = time.monotonic() - t0
    # the machine's busy CPU over the job less the bench's own (workers, verifiers, simulator, PostgreSQL: the
    # latter counts other clients' queries too): what other work took from the cores meanwhile
    others_cores = max(0.0, machine_s - (cpu_workers + cpu_verifiers + sim_cpu + pg_cpu)) / max(1e-9, job_wall)
    chunk_rows = list(JobChunk.objects.filter(job=job).order_by("index").values_list(
        "start_row", "end_row", "started_at", "finished_at"))
    chunk_s = [(f - s).total_seconds() for _, _, s, f in chunk_rows if s and f]
    gaps = [(b[2] - a[3]).total_seconds() for a, b in zip(chunk_rows, chunk_rows[1:]) if a[3] and b[2]]
    rows = Rollout.objects.filter(job=job).count()
    dup = (Rollout.objects.filter(job=job).values("task_index", "rollout_index").annotate(c=Count("id"))
           .filter(c__gt=1).count())
    per_worker = Rollout.objects.filter(job=job).values("worker").annotate(c=Count("id"))
    hosts = collections.Counter()
    for r in per_worker:
        hosts[":".join(r["worker"].split(":")[:2])] += r["c"]
    # the first stored batch arrives a flush after the first request: time counted from when the first rows were
    # seen, and those rows left out of the count (they were stored before it: a 10,000-row job read ~5 % fast)
    secs = max(1e-9, t_last - (t_first or t0))
    own = [sampler.peak_own[w.popen.pid] * MB for w in workers]
    total = [sampler.peak_total[w.popen.pid] * MB for w in workers]
    return {"n": n, "workers": n_workers, "state": job.state, "rows": rows, "duplicates": dup,
            "failed": job.failed_count, "secs": secs, "rps": (n - stored_first) / secs, "job_secs": job_wall,
            "wait_ms_per_rollout": wait_s * 1000 / max(1, rows), "others_cores": others_cores,
            "chunk_secs": [round(x, 2) for x in chunk_s], "chunk_gap_secs": [round(x, 3) for x in gaps],
            "chunk_rps": [round((e - s) / d) for (s, e, *_), d in zip(chunk_rows, chunk_s) if d > 0],
            "chunk_size": chunk_size, "peak_rss_mb": max(own), "peak_rss_mb_each": [round(x) for x in own],
            "peak_rss_with_children_mb": max(total), "rss_at_10pct_mb": rss_early or 0.0,
            "peak_rss_collecting_mb": rss_collecting or 0.0, "rss_timeline": timeline, "worker_cpu_ms_per_rollout": cpu_workers * 1000 / max(1, rows),
            "verifier_cpu_ms_per_rollout": cpu_verifiers * 1000 / max(1, rows),
            "simulator_cpu_ms_per_rollout": sim_cpu * 1000 / max(1, rows), "postgres_cpu_ms_per_rollout":
            pg_cpu * 1000 / max(1, rows), "chunks": -(-n // chunk_size), "rows_per_worker": sorted(hosts.values(), reverse=True),
            "error": job.error_message}


def workers_mode(args, tmp: Path, queue: str) -> dict:
    os.environ["ENGINE_EVENT_LOOP"] = args.worker_loop  # the Worker processes inherit it
    sim, sim_url = start_simulator(args.latency_ms, max_num_seqs=max(1024, args.parallelism * 2))
    print(f"simulator {sim_url} ({args.latency_ms:.0f} ms), parallelism {args.parallelism} (bound "
          f"{(args.parallelism / (args.latency_ms / 1000)) if args.latency_ms else float('inf'):.0f} rollouts/s), verifier {args.verifier}, {os.cpu_count()} CPUs",
          flush=True)
    out = []
    try:
        user, ep = fixtures(sim_url)
        t = time.monotonic()
        _, dataset = make_dataset(user, max(args.sizes), tmp)
        print(f"  dataset of {max(args.sizes)} rows ingested in {time.monotonic() - t:.0f}s", flush=True)
        for n in args.sizes:
            for k in args.workers:
                r = run_job_on_workers(args, user, dataset, ep, n, k, tmp, queue, sim.pid)
                out.append(r)
                print(f"  {n} rollouts on {k} worker(s): {r['state']}, {r['rows']} rows ({r['duplicates']} duplicated), "
                      f"{r['rps']:.0f} rollouts/s, peak RSS per worker {r['peak_rss_mb_each']} MB (collecting "
                      f"{r['peak_rss_collecting_mb']:.0f}), rows per worker {r['rows_per_worker']}, load average "
                      f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; RSS MB at 10..100 %: "
                      f"{' '.join(str(mb) for _, _, mb in r['rss_timeline'])}", flush=True)
    finally:
        sim.terminate()
        sim.wait(10)
    print(f"\none job, N worker processes (celery -P threads -c 1 each), simulator at {args.latency_ms:.0f} ms, "
          f"total parallelism {args.parallelism}:")
    base = {r["n"]: r["rps"] for r in out if r["workers"] == min(args.workers)}
    print_table(["rollouts", "workers", "chunks", "state", "rows stored", "duplicates", "failed", "rollouts/s",
                 "x 1 worker", "CPU ms/rollout workers", "verifiers", "simulator", "postgres", "run-queue wait ms/rollout",
                 "others' cores", "RSS/worker MB @10%", "peak collecting", "peak incl. finalize", "+children MB",
                 "rows per worker"],
                [[r["n"], r["workers"], f"{r['chunks']} x {r['chunk_size']}", r["state"], r["rows"], r["duplicates"],
                  r["failed"], f"{r['rps']:.0f}", f"{r['rps'] / base[r['n']]:.2f}",
                  f"{r['worker_cpu_ms_per_rollout']:.2f}", f"{r['verifier_cpu_ms_per_rollout']:.2f}",
                  f"{r['simulator_cpu_ms_per_rollout']:.2f}", f"{r['postgres_cpu_ms_per_rollout']:.2f}",
                  f"{r['wait_ms_per_rollout']:.2f}", f"{r['others_cores']:.2f}", f"{r['rss_at_10pct_mb']:.0f}",
                  f"{r['peak_rss_collecting_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_with_children_mb']:.0f}",
                  "/".join(map(str, r["rows_per_worker"]))] for r in out])
    print("CPU ms/rollout: user + system CPU over the job, per stored rollout, of the worker processes (engine, DB "
          "thread, Celery), of their verifier-pool children, of the simulator, and of every PostgreSQL backend (the "
          "server is shared: other clients' queries count too). Run-queue wait: the time the workers, their verifier "
          "processes and the simulator were runnable but another process held the core (/proc/PID/task/*/schedstat); "
          "others' cores: the machine's busy CPU over the job less the bench's own, per second.")
    print("\nper chunk (started -> finished, from the chunk rows): rollouts/s of each chunk in order; gaps: seconds "
          "from a chunk's end to the next one's start")
    for r in out:
        print(f"  {r['n']} x {r['workers']}: {' '.join(map(str, r['chunk_rps']))}   gaps "
              f"{' '.join(f'{g:.2f}' for g in r['chunk_gap_secs'])}")
    print("\nworker RSS now (MB) as the job's rows reach 10 %, 20 % ... 100 % (s from the first row):")
    for r in out:
        print(f"  {r['n']} x {r['workers']}: " + "  ".join(f"{p}%:{mb}({s}s)" for p, s, mb in r["rss_timeline"]))
    if len(args.sizes) >= 2:
        small, big = min(args.sizes), max(args.sizes)
        print(f"\npeak RSS per worker, {big} vs {small} rollouts (flat = ~1.0):")
        rows = []
        for k in args.workers:
            a = next(r for r in out if r["n"] == small and r["workers"] == k)
            b = next(r for r in out if r["n"] == big and r["workers"] == k)
            rows.append([k, f"{a['peak_rss_mb']:.0f}", f"{b['peak_rss_mb']:.0f}", f"{b['peak_rss_mb'] / a['peak_rss_mb']:.2f}"])
        print_table(["workers", f"{small} MB", f"{big} MB", "ratio"], rows)
        print(f"\neach run vs the first {small}-rollout run on as many workers (rate >= 0.9x and memory flat = ~1.0):")
        rows = []
        for r in out:
            a = next(x for x in out if x["n"] == small and x["workers"] == r["workers"])
            rows.append([r["n"], r["workers"], f"{r['rps']:.0f}", f"{r['rps'] / a['rps']:.2f}",
                         f"{r['peak_rss_collecting_mb']:.0f}", f"{r['peak_rss_collecting_mb'] / a['peak_rss_collecting_mb']:.2f}",
                         f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] / a['peak_rss_mb']:.2f}"])
        print_table(["rollouts", "workers", "rollouts/s", "x rate", "peak collecting MB", "x", "peak incl. finalize MB",
                     "x"], rows)
    return {"workers": out}


# ------------------------------------------------------------------------------------------------
# inflight: 16,384 requests at once through the engine
# ------------------------------------------------------------------------------------------------
class CountingSink:
    """Keeps counts only (the engine's own memory is what is measured)."""

    def __init__(self):
        self.ok = self.failed = 0
        self.classes = collections.Counter()
        self.max_in_flight = 0
        self.t_first_done = self.t_last_done = None
        self.done_at: list[float] = []  # monotonic time of every result

    async def rollout(self, result):
        now = time.monotonic()
        self.t_first_done = self.t_first_done or now
        self.t_last_done = now
        self.done_at.append(now)
        if result.ok:
            self.ok += 1
        else:
            self.failed += 1
            self.classes[result.failure_class or "unknown"] += 1

    async def progress(self, tick):
        self.max_in_flight = max(self.max_in_flight, tick.in_flight)
        for k, v in (tick.errors or {}).items():
            self.classes[f"event:{k}"] += v

    async def close(self):
        pass


def inflight_mode(args) -> dict:
    results = [inflight_once(args, arm) for arm in args.loops]
    conc, latency = args.inflight, args.latency_s
    print(f"\n{conc} requests in flight through the engine at {latency:.0f} s latency ({args.waves} waves, verifier "
          f"{args.inflight_verifier}); event loop of the engine and the simulator (-plain: not streamed) side by side:")
    print_table(["loop", "in flight", "rollouts", "ok", "failed", "wall s", "rollouts/s", "bound", "ratio",
                 "sustained rollouts/s", "sustained ratio", ">= 0.9",
                 "max in flight seen", "engine peak RSS MB", "+children MB", "simulator peak RSS MB",
                 "CPU ms/rollout engine", "simulator", "errors"],
                [[r["loop"], conc, r["rollouts"], r["ok"], r["failed"], f"{r['wall_s']:.1f}", f"{r['rps']:.0f}",
                  f"{r['bound']:.0f}", f"{r['ratio']:.2f}", f"{r['sustained_rps']:.0f}", f"{r['sustained_ratio']:.2f}",
                  "yes" if r["sustained_ratio"] >= 0.9 and not r["failed"] else "NO",
                  r["max_in_flight_seen"], f"{r['engine_peak_rss_mb']:.0f}",
                  f"{r['engine_peak_rss_with_children_mb']:.0f}", f"{r['simulator_peak_rss_mb']:.0f}",
                  f"{r['engine_cpu_ms_per_rollout']:.2f}", f"{r['simulator_cpu_ms_per_rollout']:.2f}",
                  r["errors"] or "none"] for r in results])
    print(f"rollouts/s = rollouts / wall, wall from the engine's start to its last result ({args.waves} waves: "
          f"the ideal wall is {args.waves} x {latency:.0f} s, plus the ramp: opening {conc} connections and sending "
          f"the first {conc} requests); bound = in flight / latency. Sustained = the results of the {args.waves - 1} "
          f"latency period(s) that follow the first result, over their length: the rate once all requests are in "
          f"flight, which a long collection runs at (the ramp is paid once). CPU ms/rollout: user+system "
          f"CPU of the engine process / of the simulator over the run: at the bound, (engine + simulator) x "
          f"{conc / latency:.0f}/s must fit in the free cores.")
    return {"inflight": results}


def inflight_once(args, arm: str) -> dict:
    """arm: an event loop name (asyncio, uvloop), '-plain' for non-streaming requests (no SSE: no TTFT)."""
    loop, _, plain = arm.partition("-")
    from workers.engine.fdlimit import open_file_limit, raise_open_file_limit
    from workers.engine.loop import run as run_on_loop
    from workers.engine.runner import run_collection
    from workers.engine.types import CollectionSpec, EndpointSpec, TaskItem

    raise_open_file_limit()
    soft, hard = open_file_limit()
    conc, latency = args.inflight, args.latency_s
    n = args.waves * conc
    sim, sim_url = start_simulator(latency * 1000, max_num_seqs=conc + 1024, loop=loop)
    print(f"[{arm}] simulator {sim_url} ({latency:.0f} s), {conc} in flight x {args.waves} waves = {n} rollouts, "
          f"open-file limit {soft} (hard {hard}), verifier {args.inflight_verifier}", flush=True)
    sink = CountingSink()
    sampler = RssSampler([os.getpid(), sim.pid], children=True)
    sampler.sample()
    sampler.start()
    try:
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim_url], model=MODEL, request_timeout_s=latency * 6,
                                                    connect_timeout_s=30.0, max_retries=2),
                              parallelism=conc, verifier=args.inflight_verifier, stream=plain != "plain",
                              responses_create_params={"max_output_tokens": args.max_tokens})
        tasks = (TaskItem(task_index=i, rollout_index=0,
                          row={"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
                               "expected_answer": str(i + 1)}) for i in range(n))
        cpu_engine0 = sum(psutil.Process().cpu_times()[:2])
        t0 = time.monotonic()
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
            summary = prof.runcall(run_on_loop, run_collection(spec, tasks, sink), loop)
            prof.dump_stats(f"{args.profile}.{arm}")
        else:
            summary = run_on_loop(run_collection(spec, tasks, sink), loop)
        wall = time.monotonic() - t0
        cpu_engine = sum(psutil.Process().cpu_times()[:2]) - cpu_engine0
        try:
            cpu_sim = sum(psutil.Process(sim.pid).cpu_times()[:2])
        except psutil.Error:
            cpu_sim = float("nan")
    finally:
        sampler.stop.set()
        sampler.join()
        sim.terminate()
        sim.wait(10)
    bound = conc / latency
    done = sink.ok + sink.failed
    rps = done / wall
    # the rate once every slot is in flight: results in the (waves - 1) latency periods after the first one
    window = (args.waves - 1) * latency
    t1 = sink.t_first_done or t0
    sustained = sum(1 for t in sink.done_at if t1 <= t < t1 + window) / window if window > 0 else float("nan")
    r = {"loop": arm, "in_flight": conc, "latency_s": latency, "rollouts": n, "ok": sink.ok, "failed": sink.failed,
         "errors": dict(sink.classes), "wall_s": wall, "rps": rps, "bound": bound, "ratio": rps / bound,
         "sustained_rps": sustained, "sustained_ratio": sustained / bound,
         "max_in_flight_seen": sink.max_in_flight, "engine_peak_rss_mb": sampler.peak_own[os.getpid()] * MB,
         "engine_peak_rss_with_children_mb": sampler.peak_total[os.getpid()] * MB,
         "simulator_peak_rss_mb": sampler.peak_own[sim.pid] * MB, "nofile": [soft, hard],
         "fatal": summary.fatal_error, "engine_cpu_ms_per_rollout": cpu_engine * 1000 / max(1, done),
         "simulator_cpu_ms_per_rollout": cpu_sim * 1000 / max(1, done)}
    print(f"  [{arm}] {r['rps']:.0f} rollouts/s = {r['ratio']:.2f} x bound (sustained {r['sustained_rps']:.0f}/s = "
          f"{r['sustained_ratio']:.2f} x), {r['failed']} failed, max in flight "
          f"{r['max_in_flight_seen']}", flush=True)
    return r



def main(argv=None) -> int:
    def ints(text):
        return [int(x) for x in text.split(",") if x.strip()]

    p = argparse.ArgumentParser(prog="python -m bench.bench_scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", nargs="?", choices=["all", "workers", "inflight"], default="all")
    p.add_argument("--sizes", type=ints, default=[10_000, 100_000], help="job sizes in rollouts (default 10000,100000)")
    p.add_argument("--workers", type=ints, default=[1, 2, 4], help="worker process counts (default 1,2,4)")
    p.add_argument("--parallelism", type=int, default=512, help="the job's total num_samples_in_parallel (default 512)")
    p.add_argument("--latency-ms", type=float, default=200.0, help="simulator latency for 'workers' (default 200)")
    p.add_argument("--verifier", default="math", help="the job's verifier in 'workers' (default math)")
    p.add_argument("--worker-loop", default="asyncio", help="'workers': ENGINE_EVENT_LOOP of the workers (default asyncio)")
    p.add_argument("--chunk-size", type=int, default=0, help="job chunk size (default: N / (4 x max workers))")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (default 8)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--inflight", type=int, default=16_384, help="requests in flight for 'inflight' (default 16384)")
    p.add_argument("--latency-s", type=float, default=10.0, help="simulator latency for 'inflight' (default 10)")
    p.add_argument("--waves", type=int, default=3, help="rollouts = waves x in flight (default 3; at least 2 "
                   "for a sustained rate)")
    p.add_argument("--inflight-verifier", default="none", help="verifier in 'inflight' (default none: the "
                   "transport is measured; 'math' adds math-verify in the process pool)")
    p.add_argument("--loops", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=["asyncio", "uvloop", "uvloop-plain"],
                   help="'inflight': arms to compare: the event loop of the engine and the simulator, '-plain' = "
                        "non-streaming requests (default asyncio,uvloop,uvloop-plain)")
    p.add_argument("--profile", default=None, metavar="PATH", help="'inflight': cProfile the engine into PATH; "
                   "'workers': run each worker under yappi (all threads, CPU clock), profiles written into the "
                   "folder PATH (bench/yappi_worker.py)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"bench database, created and dropped (default {DEFAULT_DB})")
    p.add_argument("--keep-db", action="store_true", help="do not drop the bench database at the end")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    data = {}
    if args.part in ("all", "inflight"):
        data.update(inflight_mode(args))
    if args.part in ("all", "workers"):
        queue = f"bench-scale-{uuid.uuid4().hex[:8]}"
        with bench_database(args.db, queue, keep=args.keep_db), tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
            data.update(workers_mode(args, Path(tmp), queue))
    write_json(args.json, args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
