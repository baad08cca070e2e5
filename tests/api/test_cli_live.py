"""rolloutctl against a LIVE server: the web app and a real Celery worker run as subprocesses on this test's
database (a queue of their own, so no other worker on the shared Redis sees the tasks), the simulator serves
the model, and the CLI (also a subprocess) speaks only HTTP. Jobs really run: chunks go through Celery,
the engine, the simulator and the math verifier into PostgreSQL.

Must show: a passing gate exits 0; a failing gate exits non-zero naming the metric and both numbers."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from django.db import connection
from tests.factories import api_token
from tests.lanes import serve_control

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_math.jsonl"


def _database_url():
    s = connection.settings_dict
    auth = s["USER"] or ""
    if s.get("PASSWORD"):
        auth += ":" + s["PASSWORD"]
    return f"postgres://{auth}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Proc:
    def __init__(self, name, args, env, log_dir):
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def tail(self, n=3000):
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self):
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self.log.close()


@pytest.fixture
def stack(transactional_db, tmp_path, django_user_model):
    """Web server + Celery worker on the test database; yields (url, token)."""
    user = django_user_model.objects.create_user(username="ci", password="pw")
    token = api_token(user)
    queue = f"api-cli-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue,
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "PYTHONUNBUFFERED": "1",
           "VERIFIER_PATH_MODULES": "tests.verifier_plugins"}  # users may name the test plugins' verifiers
    port = _free_port()
    procs = [
        Proc("web", [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"], env, tmp_path),
        Proc("worker", [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "2",
                        "-Q", serve_control(queue), "-n", f"{queue}@%h", "--without-gossip", "--without-mingle", "-l", "info"],
             env, tmp_path),
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/api/schema/", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert procs[0].popen.poll() is None, "web server exited:\n" + procs[0].tail()
            assert time.monotonic() < deadline, "web server not up:\n" + procs[0].tail()
            time.sleep(0.5)
        deadline = time.monotonic() + 90
        while b"ready" not in procs[1].log_path.read_bytes():
            assert procs[1].popen.poll() is None, "worker exited:\n" + procs[1].tail()
            assert time.monotonic() < deadline, "worker not ready:\n" + procs[1].tail()
            time.sleep(0.5)
        yield url, token, procs
    finally:
        for p in procs:
            p.stop()


def cli(url, token, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(ROLLOUTCTL_URL=url, ROLLOUTCTL_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "rolloutctl", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_cli_run_gate_export_against_live_server(stack, simulator_factory, tmp_path):
    url, token, procs = stack
    sim = simulator_factory(ttft_ms=5, itl_ms=0, jitter=0, seed=3, math_accuracy=0.7)
    out = tmp_path / "out" / "rollouts.jsonl"
    common = ["--dataset", DEMO, "--endpoint-url", sim.url, "--model", sim.model, "--limit", 40, "--num-repeats", 2,
              "--num-samples-in-parallel", 8, "--chunk-size", 20, "--temperature", 0.7, "--max-output-tokens", 64,
              "--idempotency-key", "ci-build-1", "--timeout", 240, "--poll-interval", 0.5]

    # submit + wait (progress bar) + export + a passing gate, in one command
    r = cli(url, token, "run", *common, "--metric", "mean/reward", "--min", 0.3, "--max", 1.0, "-o", out)
    logs = "\n".join(p.tail() for p in procs)
    assert r.returncode == 0, f"stdout:{r.stdout}\nstderr:{r.stderr}\nserver:{logs}"
    job_id = int(r.stdout.strip().splitlines()[-1])
    assert "uploaded dataset" in r.stderr and "created endpoint" in r.stderr
    assert re.search(r"gate passed: mean/reward = 0\.\d+ >= min 0\.30 and <= max 1\.00", r.stderr), r.stderr
    assert "rollout" in r.stderr and "80/80" in r.stderr  # the tqdm bar reached the end

    job = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{url}/api/jobs/{job_id}/", headers={"Authorization": f"Token {token}"}), timeout=10).read())
    assert job["state"] == "completed" and job["progress"]["done"] == 80
    mean = job["aggregate_metrics"]["mean/reward"]
    assert 0.3 <= mean <= 1.0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == job["progress"]["completed"]
    assert all("response" in x and "reward" in x and "_ng_task_index" in x and "_ng_rollout_index" in x for x in rows)
    assert json.loads((tmp_path / "out" / "rollouts_aggregate_metrics.json").read_text())["mean/reward"] == mean

    # a failing gate: non-zero, naming the metric and both numbers
    r = cli(url, token, "gate", job_id, "--metric", "mean/reward", "--min", 0.95)
    assert r.returncode == 1, r.stderr
    m = re.search(r"gate failed: mean/reward = (\d\.\d+) < min 0\.95", r.stderr)
    assert m, r.stderr
    assert abs(float(m.group(1)) - mean) < 0.01
    r = cli(url, token, "gate", job_id, "--metric", "mean/reward", "--max", 0.1, "--metric", "failed_fraction",
            "--max", 0.5)
    assert r.returncode == 1 and re.search(r"gate failed: mean/reward = \d\.\d+ > max 0\.10", r.stderr), r.stderr
    assert "gate passed: failed_fraction" in r.stderr
    r = cli(url, token, "gate", job_id, "--metric", "mean/nonexistent", "--min", 0)
    assert r.returncode == 1 and "mean/nonexistent is not available" in r.stderr

    # the same CI step retried with the same idempotency key: the same job, no second one
    r = cli(url, token, "run", *common, "--metric", "mean/reward", "--min", 0.3, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) == job_id
    assert "already uploaded" in r.stderr and "using endpoint" in r.stderr and "already submitted" in r.stderr

    # export on its own (streamed to a file), wait on a finished job
    r = cli(url, token, "export", job_id, "-o", tmp_path / "all.jsonl", "--which", "all")
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == 80
    assert cli(url, token, "wait", job_id, "--no-progress").returncode == 0

    # API errors are shown with the API's own body
    r = cli(url, "wrong-token", "gate", job_id, "--metric", "mean/reward", "--min", 0)
    assert r.returncode == 5 and "HTTP 401" in r.stderr and "Invalid token" in r.stderr
    r = cli(url, token, "gate", 10**9, "--metric", "mean/reward", "--min", 0)
    assert r.returncode == 5 and "HTTP 404" in r.stderr


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cli_wait_timeout_and_cancelled_job(stack, simulator_factory, tmp_path):
    url, token, _ = stack
    slow = simulator_factory(ttft_ms=20000, seed=1)
    r = cli(url, token, "submit", "--dataset", DEMO, "--endpoint-url", slow.url, "--model", slow.model,
            "--limit", 2, "--num-samples-in-parallel", 2)
    assert r.returncode == 0, r.stderr
    job_id = int(r.stdout.strip())
    t0 = time.monotonic()
    r = cli(url, token, "wait", job_id, "--timeout", 2, "--poll-interval", 0.5)
    assert r.returncode == 4 and "timed out after 2 s" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30
    req = urllib.request.Request(f"{url}/api/jobs/{job_id}/cancel/", method="POST",
                                 headers={"Authorization": f"Token {token}"})
    assert json.loads(urllib.request.urlopen(req, timeout=10).read())["state"] == "cancelled"
    r = cli(url, token, "wait", job_id, "--no-progress")
    assert r.returncode == 3 and "cancelled" in r.stderr
    r = cli(url, token, "run", "--dataset-id", 10**9, "--endpoint", 1, "--no-progress")
    assert r.returncode == 5 and "HTTP 400" in r.stderr and "dataset" in r.stderr


def _api(url, token, method, path, body=None):
    req = urllib.request.Request(f"{url}/api/{path}", method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), json.loads(r.read() or b"null")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cli_login_and_ops_actions_run_in_the_worker(stack, simulator_factory, django_user_model):
    """Model-server operations run in the Celery worker: the web answers 202 at once, even when the model server
    hangs, and the report lands on the action; `rolloutctl` polls it. `login` issues a token, `logout`
    revokes it."""
    from controlplane.endpoints.models import AdminAction, AdminOperation, Endpoint

    url, token, _ = stack
    # login: a new token that works; logout revokes that one only
    env = {**os.environ, "ROLLOUTCTL_PASSWORD": "pw"}
    r = subprocess.run([sys.executable, "-m", "rolloutctl", "login", "--url", url, "--username", "ci"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    fresh = r.stdout.strip()
    assert len(fresh) == 64 and fresh != token and "valid until" in r.stderr
    assert _api(url, fresh, "GET", "endpoints/")[0] == 200
    assert cli(url, fresh, "logout").returncode == 0
    r = cli(url, fresh, "ops-stats", 1)
    assert r.returncode == 5 and "HTTP 401" in r.stderr
    r = cli(url, fresh, "admin-stats", 1)  # the deprecated name still runs ops-stats, and says so on stderr
    assert r.returncode == 5 and "HTTP 401" in r.stderr and "'admin-stats' is deprecated; use 'ops-stats'" in r.stderr

    sim = simulator_factory(update_weights_ms=50)
    ep = Endpoint.objects.create(owner=django_user_model.objects.get(username="ci"), name="sim", base_url=sim.url,
                                 model_name=sim.model, max_retries=0)
    r = cli(url, token, "update-weights", ep.pk, "--checkpoint-id", "ck-1", "--poll-interval", 0.2, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["applied"] and out["version"] == "1"
    assert [o["kind"] for o in out["operations"]] == ["pause", "update_weights", "resume"]
    assert sim.get_json("/weight_version")["weight_version"] == 1
    action = AdminAction.objects.get(trace_id=out["trace_id"])
    assert action.state == "succeeded" and action.source == "api" and action.started_at >= action.created_at
    # the trainer's own trace id, and the POST that answers when the update ended (?wait): no polling
    trace = "0123456789abcdef0123456789abcdef"
    r = cli(url, token, "update-weights", ep.pk, "--checkpoint-id", "ck-2", "--trace-id", trace, "--poll-interval", 30,
            timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["trace_id"] == trace and out["version"] == "2"
    assert AdminOperation.objects.filter(trace_id=trace).count() == 3

    # a model server that does not answer: the web process answers 202 at once (it never calls the server)
    sim.configure(admin_faults={"health": "stall"})
    t0 = time.monotonic()
    status, headers, body = _api(url, token, "POST", f"endpoints/{ep.pk}/ops/health/", {})
    assert status == 202 and time.monotonic() - t0 < 2.0
    assert body["state"] in ("queued", "running") and headers["Location"] == body["url"]
    assert body["url"] == f"{url}/api/endpoints/{ep.pk}/ops/actions/{body['id']}/"
    # the CLI gives up waiting (exit 4) while the worker keeps on; the worker records the replica as unanswered
    r = cli(url, token, "endpoint-op", ep.pk, "health", "--wait", 1, "--poll-interval", 0.2)
    assert r.returncode == 4 and "still" in r.stderr, r.stderr
    deadline = time.monotonic() + 60
    while _api(url, token, "GET", f"endpoints/{ep.pk}/ops/actions/{body['id']}/")[2]["state"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    done = _api(url, token, "GET", f"endpoints/{ep.pk}/ops/actions/{body['id']}/")[2]
    assert done["result"]["unanswered"] == [sim.url] and done["result"]["operations"][0]["status"] == "no_answer"
