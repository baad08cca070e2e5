"""Fixtures that build and start real vLLM on CPU (scripts/vllm_cpu.sh).

`vllm_server` (session scope) starts vLLM with the tiny local model on a free loopback port with the
dev-mode admin routes, waits until /health answers, yields a `VLLMServer` (`.url`, `.model`, `.port`,
`.log_path`, `.log_tail()`), and stops it at the end of the session.

It fails (never skips) when `.venv-vllm` is not set up: CI must run the `vllm` tests, and
`make test` runs `bash scripts/vllm_cpu.sh setup` first.
"""
from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "vllm_cpu.sh"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_DIR = ROOT / "var" / "tiny-model"
START_TIMEOUT_S = int(os.environ.get("VLLM_TEST_START_TIMEOUT", "180"))


@dataclass
class VLLMServer:
    url: str  # http://127.0.0.1:PORT (append /v1/..., /metrics, /pause ...)
    model: str  # the served model name: "tiny"
    port: int
    log_path: Path
    run_dir: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_setup_problem() -> str | None:
    """Why vLLM cannot start here, or None when it is set up."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} does not exist"
    if not (MODEL_DIR / ".built").exists():
        return f"the tiny model is not built in {MODEL_DIR}"
    return None


def _script(args: list[str], run_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_RUN_DIR=str(run_dir), VLLM_START_TIMEOUT=str(START_TIMEOUT_S))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    problem = vllm_setup_problem()
    if problem:
        pytest.fail(f"real vLLM on CPU is not set up ({problem}): run `bash scripts/vllm_cpu.sh setup`",
                    pytrace=False)
    run_dir = tmp_path_factory.mktemp("vllm")
    port = free_port()
    server = VLLMServer(url=f"http://127.0.0.1:{port}", model="tiny", port=port,
                        log_path=run_dir / "vllm.log", run_dir=run_dir)
    try:
        proc = _script(["start", str(port)], run_dir, timeout=START_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        _script(["stop"], run_dir, timeout=30)
        pytest.fail(f"vLLM did not start within {START_TIMEOUT_S + 30}s; log tail:\n{server.log_tail()}", pytrace=False)
    if proc.returncode != 0:
        _script(["stop"], run_dir, timeout=30)
        pytest.fail(f"vLLM failed to start on port {port}:\n{proc.stderr[-3000:]}\nlog tail ({server.log_path}):\n"
                    f"{server.log_tail()}", pytrace=False)
    try:
        yield server
    finally:
        _script(["stop"], run_dir, timeout=60)
