"""Fixtures that start the built-in simulator on loopback.

- `simulator_factory(*cli_args, **knobs) -> SimulatorProcess`: starts `python -m workers.simulator`
  as a subprocess on a free port (`--port 0`, the port is read from its ready line), waits for
  /health (15 s), and stops it at teardown. Knobs are CLI flags as keywords: `ttft_ms=100` ->
  `--ttft-ms 100`, `fault_rates={"429": 0.1}` -> `--fault-rate 429=0.1`, `unhealthy=True` ->
  `--unhealthy`; raw strings in `cli_args` are passed through.
- `simulator`: one with zero latency, seed 0, default capacity (256 seqs).
- `simulator_session`: the same, shared by the whole session (do not reconfigure it; use your own
  from `simulator_factory` when a test changes knobs).
- `start_simulator(...)`: the plain function behind both, for fixtures of other scopes (call
  `.stop()` yourself).

SimulatorProcess: `.url` ("http://127.0.0.1:PORT"), `.base_url` (url + "/v1"), `.port`, `.model`,
`.proc` (Popen), `.configure(**knobs) -> dict` (POST /admin/config; raises SimulatorError with the
server's message on 400), `.config() -> dict`, `.metrics_text() -> str`, `.get_json(path)`,
`.post_json(path, body=None)`, `.log() -> str` (its stderr), `.stop()`.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "sim-model"


class SimulatorError(RuntimeError):
    pass


def knob_args(knobs: dict) -> list[str]:
    out: list[str] = []
    for k, v in knobs.items():
        flag = "--" + k.replace("_", "-")
        if k == "fault_rates":
            flag = "--fault-rate"
            if isinstance(v, dict):
                v = ",".join(f"{t}={r}" for t, r in v.items())
        if v is True:
            out.append(flag)
        elif v is False or v is None:
            continue
        else:
            out += [flag, str(v)]
    return out


class SimulatorProcess:
    def __init__(self, proc: subprocess.Popen, url: str, model: str, log_path: str):
        self.proc = proc
        self.url = url
        self.base_url = url + "/v1"
        self.port = int(url.rsplit(":", 1)[1])
        self.model = model
        self.log_path = log_path

    # -- HTTP helpers (stdlib, blocking; fine from tests) --
    def _request(self, method: str, path: str, body=None, timeout: float = 10.0):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get_json(self, path: str):
        status, raw = self._request("GET", path)
        if status != 200:
            raise SimulatorError(f"GET {path}: HTTP {status}: {raw[:500]!r}")
        return json.loads(raw)

    def post_json(self, path: str, body=None):
        status, raw = self._request("POST", path, body if body is not None else {})
        if status != 200:
            raise SimulatorError(f"POST {path}: HTTP {status}: {raw[:500]!r}")
        return json.loads(raw) if raw else None

    def configure(self, **knobs) -> dict:
        """POST /admin/config with these knobs (JSON names: ttft_ms, fault_rates, ...); returns the new config."""
        status, raw = self._request("POST", "/admin/config", knobs)
        if status != 200:
            try:
                msg = json.loads(raw)["error"]["message"]
            except Exception:  # noqa: BLE001
                msg = raw[:500]
            raise SimulatorError(f"/admin/config refused {knobs}: HTTP {status}: {msg}")
        return json.loads(raw)

    def config(self) -> dict:
        return self.get_json("/admin/config")

    def metrics_text(self) -> str:
        status, raw = self._request("GET", "/metrics")
        if status != 200:
            raise SimulatorError(f"/metrics: HTTP {status}")
        return raw.decode()

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __repr__(self):
        return f"<SimulatorProcess {self.url} pid={self.proc.pid}>"


def start_simulator(*cli_args: str, timeout: float = 15.0, **knobs) -> SimulatorProcess:
    args = [str(a) for a in cli_args] + knob_args(knobs)
    model = knobs.get("model") or DEFAULT_MODEL
    for flag in ("--model", "--served-model-name"):
        if flag in args:
            model = args[args.index(flag) + 1]
    fd, log_path = tempfile.mkstemp(prefix="simulator-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.simulator", "--host", "127.0.0.1", "--port", "0", *args],
            cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=log, text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    url = None
    if line and "http://" in line[0]:
        url = line[0].split("http://", 1)[1].split()[0]
        url = "http://" + url
    sim = SimulatorProcess(proc, url or "http://127.0.0.1:0", model, log_path)
    if url is None:
        err = sim.log()
        sim.stop()
        raise SimulatorError(f"simulator did not start (exit {proc.poll()}): {err[-2000:]}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, _ = sim._request("GET", "/health", timeout=2)
            if status in (200, 503):  # 503 when started --unhealthy on purpose
                return sim
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            err = sim.log()
            sim.stop()
            raise SimulatorError(f"simulator at {url} never answered /health: {err[-2000:]}")
        time.sleep(0.05)


@pytest.fixture
def simulator_factory():
    started: list[SimulatorProcess] = []

    def factory(*cli_args: str, timeout: float = 15.0, **knobs) -> SimulatorProcess:
        sim = start_simulator(*cli_args, timeout=timeout, **knobs)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        sim.stop()


@pytest.fixture
def simulator(simulator_factory) -> SimulatorProcess:
    """Zero latency, seed 0, 256 seqs: fast enough for any functional test."""
    return simulator_factory(ttft_ms=0, itl_ms=0, jitter=0, seed=0)


@pytest.fixture(scope="session")
def simulator_session():
    """Zero latency, seed 0, shared by every test of the session: treat it as read-only."""
    sim = start_simulator(ttft_ms=0, itl_ms=0, jitter=0, seed=0)
    yield sim
    sim.stop()


@contextlib.asynccontextmanager
async def serve_locally(app):
    """A small aiohttp app of a test's own on a free local port; yields its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
