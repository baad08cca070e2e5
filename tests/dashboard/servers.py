"""Real processes for the browser tests and the benches: the ASGI web server (uvicorn, as deployed:
HTTP + WebSockets; daphne only to compare with) and a Celery worker (threads pool), both pointed at a given database and Redis URL.

They run on their own Redis database number (broker isolation: another suite's worker on the shared
Redis never takes these chunks, and this worker never takes theirs)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from tests.lanes import serve_control

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url(settings_dict) -> str:
    user = settings_dict.get("USER") or "postgres"
    pw = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{pw}@" if pw else f"{user}@"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{settings_dict['NAME']}"


def redis_url_with_db(url: str, db: int) -> str:
    base = url.rsplit("/", 1)[0] if url.count("/") >= 3 else url
    return f"{base}/{db}"


class Proc:
    def __init__(self, name, args, env, cwd=REPO):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def output(self) -> str:
        return self.full_output()[-6000:]

    def full_output(self) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout=10):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def child_env(database: str, redis: str, **extra) -> dict:
    env = dict(os.environ)
    env.update({
        "DATABASE_URL": database,
        "REDIS_URL": redis,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "WARNING",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


def web_command(server: str, port: int) -> list[str]:
    """The web server as scripts/demo.sh and docker/ start it (uvicorn), or daphne (comparisons only)."""
    if server == "daphne":
        return [str(VENV_BIN / "daphne"), "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"]
    return [str(VENV_BIN / "uvicorn"), "controlplane.asgi:application", "--host", "127.0.0.1", "--port", str(port),
            "--ws", "websockets", "--no-access-log", "--timeout-graceful-shutdown", "5"]


def start_web(env: dict, server: str = "uvicorn", timeout=30.0) -> tuple[Proc, str]:
    port = free_port()
    p = Proc(server, web_command(server, port), env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{server} exited: {p.output()}")
        try:
            urllib.request.urlopen(url + "/accounts/login/", timeout=2).read()
            return p, url
        except OSError:
            time.sleep(0.2)
    p.stop()
    raise RuntimeError(f"{server} did not answer on {url}: {p.output()}")


def start_daphne(env: dict, timeout=30.0) -> tuple[Proc, str]:
    """Kept for callers that name it: the deployed server (uvicorn)."""
    return start_web(env, "uvicorn", timeout)


def start_celery(env: dict, concurrency=2, timeout=60.0, name: str | None = None) -> Proc:
    name = f"{name or 'dashtest'}{os.getpid()}@%h"
    p = Proc("celery", [str(VENV_BIN / "celery"), "-A", "controlplane", "worker", "-P", "threads", "-c", str(concurrency),
                        "-Q", serve_control(env.get("CELERY_TASK_DEFAULT_QUEUE", "celery"), env),
                        "-l", "info", "-n", name, "--without-gossip", "--without-mingle"], env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"celery exited: {p.output()}")
        # the whole log: a worker that starts on a queue holding earlier tests' leftover tasks logs them by the
        # hundred right after its " ready." line, past the tail output() shows
        if " ready." in p.full_output():
            return p
        time.sleep(0.3)
    p.stop()
    raise RuntimeError(f"celery worker not ready: {p.output()}")


def log_in(page, username: str, password: str) -> None:
    """On the login form the page shows (the login page, or the one a protected page redirected to)."""
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-submit")
    page.wait_for_load_state()


def prepare_browser(monkeypatch) -> None:
    """Before a browser test: skip without Debian's Chromium, let the ORM run in this thread beside Playwright's
    sync API (which runs an event loop here), and build the pages' JS when it is missing."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium chromium-driver)")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    ensure_frontend()


FRONTEND_FILES = ("static/vendor/uplot/uPlot.iife.min.js", "static/vendor/d3-flame-graph/d3-flamegraph.min.js")


def ensure_frontend():
    if not all((REPO / f).exists() for f in FRONTEND_FILES):
        subprocess.run(["bash", str(REPO / "scripts/frontend.sh")], check=True, cwd=REPO)
