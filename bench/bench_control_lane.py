#!/usr/bin/env python3
"""A trainer's weight updates while collection keeps every worker slot busy, through the REST API, on the
topology `make demo` starts: before (CELERY_CONTROL_QUEUE="": one worker `-P threads -c 4` takes everything)
and after (the same worker for the chunks, plus a control worker `-Q control -c 2`), in one run.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python -m bench.bench_control_lane \
        [--seconds 45] [--every 3] [--drain 150]

For each mode, in a throwaway database (created and dropped here): the simulator (vLLM-compatible; its weight
update takes 200 ms), uvicorn, beat and the workers as subprocesses; two jobs of many chunks launched so that
every collection slot holds a chunk and many more wait; then a trainer POSTs `/api/endpoints/<id>/weights/`
every --every seconds for --seconds, and each action is followed to its end (at most --drain seconds after the
last POST; an action unfinished by then counts as "> drain"). Table: POST -> started (the action's started_at
minus the POST's send time) and POST -> succeeded, p50/p95/max, beside the stored dispatch_ms (asked -> started,
as the action records it) and the stored queue_ms of its requests (what the ops client saw); and whether the
versions came out strictly in order. One authenticated GET warms the web process up first.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone as dt_tz
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * (len(v) - 1)))))]


class Procs:
    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []

    def start(self, name, cmd, env):
        log = open(self.log_dir / f"{name}.log", "wb")
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p, log))
        return p

    def wait_log(self, name, text, timeout=90):
        path = self.log_dir / f"{name}.log"
        deadline = time.monotonic() + timeout
        while text.encode() not in path.read_bytes():
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} not ready:\n{path.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self):
        for _name, p, log in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the bench's chunks: no need to finish them
                p.wait(10)
            log.close()
        self.procs = []


def run_mode(mode: str, args, db_url: str, log_dir: Path) -> dict:
    import requests
    from django.conf import settings

    from bench.simulator_process import start_simulator_process
    from controlplane.endpoints.models import AdminAction, AdminOperation, Endpoint
    from controlplane.jobs import services
    from controlplane.jobs.models import CollectionJob, JobChunk  # noqa: F401
    from tests.factories import make_dataset, make_user, math_rows

    tag = uuid.uuid4().hex[:6]
    work, control = f"bench-work-{tag}", (f"bench-control-{tag}" if mode == "after" else "")
    settings.CELERY_CONTROL_QUEUE = control
    from controlplane.celery import app

    app.conf.task_default_queue = work
    settings.CELERY_TASK_DEFAULT_QUEUE = work
    env = {**os.environ, "DATABASE_URL": db_url, "CELERY_TASK_DEFAULT_QUEUE": work, "CELERY_CONTROL_QUEUE": control,
           "PYTHONUNBUFFERED": "1", "ENDPOINT_ALLOWED_HOSTS": "*", "JOBS_WATCHDOG_INTERVAL_S": "10"}
    procs = Procs(log_dir)
    sim, sim_url = start_simulator_process("--seed", 7, "--model", "sim", "--max-num-seqs", 64, "--ttft-ms", 120,
                                           "--itl-ms", 8, "--update-weights-ms", 200, "--math-accuracy", 0.7,
                                           stderr=subprocess.DEVNULL)
    try:
        port = _free_port()
        celery = [str(VENV_BIN / "celery"), "-A", "controlplane"]
        procs.start(f"{mode}-web", [str(VENV_BIN / "uvicorn"), "controlplane.asgi:application", "--host", "127.0.0.1",
                                    "--port", str(port)], env)
        procs.start(f"{mode}-worker", [*celery, "worker", "-P", "threads", "-c", "4", "-Q", work, "-n",
                                       f"work-{tag}@%h", "-l", "info"], env)
        if control:
            procs.start(f"{mode}-control", [*celery, "worker", "-P", "threads", "-c", "2", "-Q", control, "-n",
                                            f"control-{tag}@%h", "-l", "info"], env)
        procs.start(f"{mode}-beat", [*celery, "beat", "-l", "info", "-s", str(log_dir / f"beat-{tag}")], env)
        procs.wait_log(f"{mode}-worker", " ready.")
        if control:
            procs.wait_log(f"{mode}-control", " ready.")
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(base + "/healthz", timeout=2)
                break
            except requests.RequestException:
                if time.monotonic() > deadline:
                    raise SystemExit("web server not up")
                time.sleep(0.3)

        user = make_user(f"trainer-{tag}", token=True)
        ep = Endpoint.objects.create(owner=user, name=f"sim-{tag}", base_url=sim_url, model_name="sim",
                                     request_timeout_s=60, connect_timeout_s=5)
        jobs = [services.create_job(owner=user, dataset=make_dataset(user, rows=math_rows(600, seed=i),
                                                                     name=f"d{i}-{tag}"),
                                    endpoint=ep, num_repeats=4, chunk_size=20, num_samples_in_parallel=32, launch=True)
                for i in range(2)]
        t0 = time.monotonic()
        while JobChunk.objects.filter(job__in=jobs, state="running").count() < 4:
            if time.monotonic() - t0 > 60:
                raise SystemExit("the chunks never filled the worker's slots")
            time.sleep(0.2)
        busy_pending = JobChunk.objects.filter(job__in=jobs, state="pending").count()

        s = requests.Session()
        s.headers["Authorization"] = f"Token {user.api_token}"
        # a trainer's client is already talking to the API: the web process's first request (lazy imports, its
        # first database connection) is not what an update costs
        assert s.get(f"{base}/api/endpoints/{ep.pk}/ops/stats/", timeout=30).status_code == 200
        posted = []  # (action id, POST wall-clock time)
        t_end = time.monotonic() + args.seconds
        while time.monotonic() < t_end:
            sent = datetime.now(dt_tz.utc)
            r = s.post(f"{base}/api/endpoints/{ep.pk}/weights/", json={"checkpoint_id": f"step-{len(posted)}"},
                       timeout=30)
            assert r.status_code == 202, r.text
            posted.append((r.json()["id"], sent))
            time.sleep(args.every)
        drain_until = time.monotonic() + args.drain
        ids = [i for i, _ in posted]
        while (AdminAction.objects.filter(pk__in=ids).exclude(state__in=["succeeded", "failed"]).exists()
               and time.monotonic() < drain_until):
            time.sleep(0.5)
        slots_busy = JobChunk.objects.filter(job__in=jobs, state="running").count()
        started, succeeded, failed, unfinished = [], [], 0, 0
        for pk, sent in posted:
            a = AdminAction.objects.get(pk=pk)
            if a.started_at:
                started.append((a.started_at - sent).total_seconds() * 1000)
            if a.state == "succeeded":
                succeeded.append((a.finished_at - sent).total_seconds() * 1000)
            elif a.state == "failed":
                failed += 1
            else:
                unfinished += 1
        dispatch_ms = [d for d in AdminAction.objects.filter(pk__in=ids).values_list("dispatch_ms", flat=True)
                       if d is not None]
        queue_ms = [q for q in AdminOperation.objects.filter(endpoint=ep).values_list("queue_ms", flat=True)
                    if q is not None]
        applied = list(AdminAction.objects.filter(pk__in=ids, state="succeeded").order_by("started_at")
                       .values_list("result__version", flat=True))
        in_order = applied == sorted(applied, key=int) and len(set(applied)) == len(applied)
        for job in jobs:
            job.refresh_from_db()
            if job.state in ("queued", "running", "paused"):
                services.cancel_job(job)
        return {"mode": mode, "posted": len(posted), "started": started, "succeeded": succeeded, "failed": failed,
                "unfinished": unfinished, "queue_ms": queue_ms, "dispatch_ms": dispatch_ms, "in_order": in_order, "busy_pending": busy_pending,
                "slots_busy_at_end": slots_busy, "versions": applied}
    finally:
        procs.stop()
        sim.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--every", type=float, default=3.0)
    ap.add_argument("--drain", type=float, default=150.0)
    ap.add_argument("--modes", default="before,after")
    ap.add_argument("--log-dir", default=str(REPO / "var" / "bench-control-lane"))
    args = ap.parse_args(argv)
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    test_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    s = connection.settings_dict
    db_url = f"postgres://{s['USER']}{(':' + s['PASSWORD']) if s.get('PASSWORD') else ''}@{s.get('HOST') or '127.0.0.1'}:" \
             f"{s.get('PORT') or 5432}/{test_name}"
    results = []
    try:
        for mode in args.modes.split(","):
            print(f"-- {mode} ...", flush=True)
            results.append(run_mode(mode, args, db_url, log_dir))
            connection.close()
    finally:
        time.sleep(1)
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(f"\nweight update every {args.every:g} s for {args.seconds:g} s while 2 jobs keep all 4 collection slots busy "
          f"(simulator: update 200 ms); ms")
    print(f"{'mode':<7} | {'n':>3} | {'POST->started p50/p95/max':>27} | {'POST->succeeded p50/p95/max':>29} | "
          f"{'stored dispatch_ms p50/p95':>26} | {'stored queue_ms p50/max':>23} | unfinished | in order")
    for r in results:
        st, sc, q, d = r["started"], r["succeeded"], r["queue_ms"], r["dispatch_ms"]
        print(f"{r['mode']:<7} | {r['posted']:>3} | {_pct(st, .5):>8.0f} {_pct(st, .95):>8.0f} {max(st or [0]):>8.0f} | "
              f"{_pct(sc, .5):>9.0f} {_pct(sc, .95):>9.0f} {max(sc or [0]):>9.0f} | {_pct(d, .5):>12.0f} "
              f"{_pct(d, .95):>13.0f} | {_pct(q, .5):>11.1f} "
              f"{max(q or [0]):>11.1f} | {r['unfinished']:>10} | {r['in_order']}")
    for r in results:
        print(f"{r['mode']}: {r['busy_pending']} chunks waiting when the updates began; failed {r['failed']}; "
              f"versions {r['versions']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
