"""Peak RSS of the web process under hostile load: the server setup before hardening vs now.

Two phases against each web server, on loopback, on a throwaway PostgreSQL database:

1. flood: 20 anonymous 20 MB POSTs to /accounts/login/ at once (urlencoded bodies with a Content-Length);
2. export: GET /api/jobs/<id>/export/ of a 1,000,000-rollout job (token auth), read to the end.

"before" is the code of a git revision (default `main`), extracted to a temporary directory and served
by daphne, as `make demo` did; "after" is this checkout served by uvicorn, as `make demo` does now.
RSS of the server process is sampled every 10 ms (psutil); the table shows the idle value and the peak
of each phase, and the ratio before/after of the growth.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/13 \\
        .venv/bin/python -m bench.bench_hardening [--rows 1000000] [--posts 20] [--post-mb 20] [--before-rev main]
"""
from __future__ import annotations

import argparse
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

import psutil  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402

from tests.dashboard import servers  # noqa: E402

MB = 1024 * 1024


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval=0.01):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def fill(job_id: int, n: int) -> float:
    """n engine-shaped rollouts (~450 bytes of JSON each) in one INSERT ... SELECT."""
    from controlplane.jobs.models import Rollout

    t0 = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute(f"""
            INSERT INTO {Rollout._meta.db_table} (job_id, task_index, rollout_index, status, failure_class, error,
                reward, data, attempts, weight_version, worker, created_at)
            SELECT %s, g, 0, 'ok', '', '', 1.0,
                jsonb_build_object('_ng_task_index', g, '_ng_rollout_index', 0,
                    'responses_create_params', jsonb_build_object('input', 'What is ' || g || ' + 1?'),
                    'expected_answer', (g + 1)::text, 'reward', 1.0,
                    'response', jsonb_build_object('id', 'resp-' || g, 'output_text', repeat('x', 300))),
                1, '', '', now()
            FROM generate_series(0, %s - 1) AS g""", [job_id, n])
    return time.perf_counter() - t0


def flood(url: str, posts: int, post_mb: int) -> dict:
    host, port = url.rsplit("//", 1)[1].split(":")
    body = b"username=x&password=" + b"a" * (post_mb * MB - 20)

    def one(_):
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            conn.putrequest("POST", "/accounts/login/")
            conn.putheader("Content-Type", "application/x-www-form-urlencoded")
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            sent = 0
            try:
                view = memoryview(body)
                for i in range(0, len(body), MB):
                    conn.sock.sendall(view[i:i + MB])
                    sent += len(view[i:i + MB])
            except OSError:
                pass  # the server answered and closed before the whole body was sent
            try:
                status = conn.getresponse().status
            except (OSError, http.client.HTTPException):
                status = "closed"
            return status, sent
        finally:
            conn.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(posts) as pool:
        results = list(pool.map(one, range(posts)))
    statuses = {}
    for status, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    return {"wall_s": time.perf_counter() - t0, "statuses": statuses,
            "sent_mb": sum(s for _, s in results) / MB}


def export(url: str, token: str, job_id: int) -> dict:
    host, port = url.rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    conn.request("GET", f"/api/jobs/{job_id}/export/", headers={"Authorization": f"Token {token}"})
    resp = conn.getresponse()
    first = None
    nbytes = lines = 0
    while True:
        chunk = resp.read1(1 << 20)
        if not chunk:
            break
        if first is None:
            first = time.perf_counter() - t0
        nbytes += len(chunk)
        lines += chunk.count(b"\n")
    conn.close()
    return {"status": resp.status, "ttfb_s": first, "wall_s": time.perf_counter() - t0, "mb": nbytes / MB,
            "lines": lines}


def run_server(label: str, server: str, cwd: str, env: dict, args, job_id: int, token: str) -> dict:
    port = servers.free_port()
    cmd = servers.web_command(server, port)
    cmd[0] = os.path.join(os.path.dirname(sys.executable), server)
    proc = servers.Proc(label, cmd, env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                import urllib.request

                urllib.request.urlopen(url + "/accounts/login/", timeout=2).read()
                break
            except OSError:
                if proc.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{label} did not start: {proc.output()}")
                time.sleep(0.3)
        pid = proc.proc.pid
        out = {"idle": rss(pid)}
        sampler = RssSampler(pid)
        sampler.start()
        out["flood"] = flood(url, args.posts, args.post_mb)
        time.sleep(0.5)
        out["flood_peak"] = sampler.stop()
        out["after_flood"] = rss(pid)
        sampler = RssSampler(pid)
        sampler.start()
        out["export"] = export(url, token, job_id)
        out["export_peak"] = sampler.stop()
        print(f"{label}: {out}", file=sys.stderr, flush=True)
        return out
    finally:
        proc.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--posts", type=int, default=20)
    ap.add_argument("--post-mb", type=int, default=20)
    ap.add_argument("--before-rev", default="main", help="git revision served by daphne as 'before'")
    args = ap.parse_args(argv)

    db = settings.DATABASES["default"]
    db.setdefault("TEST", {})["NAME"] = f"bench_hardening_{os.getpid()}"
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    before_dir = tempfile.mkdtemp(prefix="cp-before-")
    try:
        subprocess.run(f"git archive {args.before_rev} | tar -x -C {before_dir}", shell=True, check=True, cwd=ROOT)
        from django.contrib.auth import get_user_model
        from controlplane.api.auth import issue_token

        from controlplane.datasets.models import Dataset
        from controlplane.endpoints.models import Endpoint
        from controlplane.jobs.models import CollectionJob

        user = get_user_model().objects.create_user("bench", password="x")
        token = issue_token(user)[0]
        ds = Dataset.objects.create(owner=user, name="bench", status="ready", row_count=args.rows)
        ep = Endpoint.objects.create(owner=user, name="bench", base_url="http://127.0.0.1:9", model_name="m")
        job = CollectionJob.objects.create(owner=user, dataset=ds, endpoint=ep, state="completed",
                                           total_rollouts=args.rows, completed_count=args.rows)
        print(f"inserted {args.rows:,} rollouts in {fill(job.pk, args.rows):.1f} s", file=sys.stderr, flush=True)
        connection.close()

        env = servers.child_env(servers.database_url(settings.DATABASES["default"]),
                                os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                                API_THROTTLE_USER_RATE="100000/min", API_THROTTLE_ANON_RATE="100000/min")
        results = {
            "before": run_server(f"before ({args.before_rev}, daphne)", "daphne", before_dir, env, args, job.pk, token),
            "after": run_server("after (this checkout, uvicorn)", "uvicorn", ROOT, env, args, job.pk, token),
        }
    finally:
        shutil.rmtree(before_dir, ignore_errors=True)
        connection.creation.destroy_test_db(old_name, verbosity=0)

    b, a = results["before"], results["after"]
    print(f"\nPeak RSS of the web process (MiB): {args.posts} anonymous {args.post_mb} MB POSTs to /accounts/login/, "
          f"then GET /api/jobs/<id>/export/ of {args.rows:,} rollouts\n")
    print(f"{'':34} {'before (daphne)':>16} {'after (uvicorn)':>16} {'before/after':>13}")

    def row(name, fb, fa, ratio=True):
        r = f"{fb / max(fa, 1e-9):>13.1f}" if ratio else f"{'':>13}"
        print(f"{name:34} {fb:>16.1f} {fa:>16.1f} {r}")

    row("idle RSS", b["idle"] / MB, a["idle"] / MB, ratio=False)
    row("flood: peak RSS", b["flood_peak"] / MB, a["flood_peak"] / MB)
    row("flood: peak growth over idle", (b["flood_peak"] - b["idle"]) / MB, (a["flood_peak"] - a["idle"]) / MB)
    row("flood: RSS kept afterwards", (b["after_flood"] - b["idle"]) / MB, (a["after_flood"] - a["idle"]) / MB)
    row("flood: MB the clients got to send", b["flood"]["sent_mb"], a["flood"]["sent_mb"])
    row("flood: wall s", b["flood"]["wall_s"], a["flood"]["wall_s"])
    row("export: peak RSS", b["export_peak"] / MB, a["export_peak"] / MB)
    row("export: peak growth over idle", (b["export_peak"] - b["after_flood"]) / MB,
        (a["export_peak"] - a["after_flood"]) / MB)
    row("export: first byte after s", b["export"]["ttfb_s"] or 0, a["export"]["ttfb_s"] or 0)
    row("export: wall s", b["export"]["wall_s"], a["export"]["wall_s"])
    print(f"\nflood answers: before {b['flood']['statuses']}, after {a['flood']['statuses']}")
    print(f"export: before {b['export']['lines']:,} lines / {b['export']['mb']:.0f} MiB (HTTP {b['export']['status']}), "
          f"after {a['export']['lines']:,} lines / {a['export']['mb']:.0f} MiB (HTTP {a['export']['status']})")


if __name__ == "__main__":
    main()
