"""Real NeMo Gym (nemo-gym 0.4.0, `ng_run`) for the `nemo_gym` tests, started by scripts/nemo_gym.sh.

- `nemo_gym`: session scope (restarted in its plain configuration where a test left another). The built-in simulator as the policy model, and `ng_run` with
  math_with_judge (its `math_with_judge_simple_agent`), a second agent `math_second_agent` on the same
  resources server, and the vllm_model model server, on a free head port. math_with_judge verifies one answer at
  a time with a long deadline (tests/data/nemo_gym_verifier.yaml): on a loaded machine its wall-clock limits
  would otherwise score some right answers 0. Skips, with the reason, only where no Python >= 3.12 exists;
  builds .venv-nemo-gym first when it is missing (about 3 min).

- `nemo_gym_tools`: module scope. The same, plus a tool-calling agent (`weather_tool_agent`: simple_agent on
  example_single_tool_call, its model server `tool_policy_model` asking for token ids) from
  tests/data/nemo_gym_tool_agent.yaml; the simulator answers a request offering tools with a call of its first
  tool (knob `tool_calls`), then in text.

NemoGym: `.head_url`, `.head_host`, `.head_port`, `.sim` (SimulatorProcess), `.venv_bin` (ng_* commands),
`.env()` (environment to run ng_collect_rollouts), `.deployment()` (resolved now), `.stop()`, `.start()`,
`.restart()`.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.fixtures_simulator import REPO_ROOT, start_simulator
from tests.fixtures_vllm import free_port

SCRIPT = REPO_ROOT / "scripts" / "nemo_gym.sh"
SECOND_AGENT_CONFIG = REPO_ROOT / "tests" / "data" / "nemo_gym_second_agent.yaml"
AGENT = "math_with_judge_simple_agent"
SECOND_AGENT = "math_second_agent"
TOOL_AGENT_CONFIG = REPO_ROOT / "tests" / "data" / "nemo_gym_tool_agent.yaml"
# math_with_judge verifying one answer at a time, with a long deadline: its wall-clock limits otherwise score a
# right answer 0 (extracted_answer None) on a loaded machine
VERIFIER_CONFIG = REPO_ROOT / "tests" / "data" / "nemo_gym_verifier.yaml"
TOOL_AGENT = "weather_tool_agent"


def _script(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=str(REPO_ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)


class NemoGym:
    def __init__(self, sim, run_dir: str):
        self.sim = sim
        self.run_dir = run_dir
        self.head_host = "127.0.0.1"
        self.head_port = free_port()
        self.head_url = f"http://{self.head_host}:{self.head_port}"
        self.venv_bin = REPO_ROOT / ".venv-nemo-gym" / "bin"
        self.extra_env: dict = {}  # e.g. NEMO_GYM_PROFILING_DIR for a restart with ng_run's profiling on
        self.started_env: dict | None = None  # extra_env of the running ng_run (None: not running)

    def env(self) -> dict:
        base = _script("python").stdout.strip()
        return {**os.environ, "NEMO_GYM_RUN_DIR": self.run_dir, "NEMO_GYM_HEAD_PORT": str(self.head_port),
                "NEMO_GYM_MODEL": self.sim.model,
                "NEMO_GYM_EXTRA_CONFIGS": f"{SECOND_AGENT_CONFIG},{VERIFIER_CONFIG}",
                "UV_PYTHON_DOWNLOADS": "never",
                "PATH": f"{self.venv_bin}:{Path(base).parent}:{os.environ.get('PATH', '')}", **self.extra_env}

    def start(self) -> None:
        env = self.env()
        res = _script("start", self.sim.base_url, env=env, timeout=float(env.get("NEMO_GYM_START_TIMEOUT", 300)) + 60)
        if res.returncode != 0:
            raise RuntimeError(f"ng_run did not start:\n{res.stderr[-4000:]}")
        self.started_env = dict(self.extra_env)

    def stop(self) -> None:
        _script("stop", env=self.env(), timeout=60)
        self.started_env = None

    def configure(self, extra_env: dict) -> None:
        """Serve with `extra_env` from now on: restarted only when it differs from what runs."""
        self.extra_env = dict(extra_env)
        if self.started_env != self.extra_env:
            self.restart()

    def restart(self) -> None:
        self.stop()
        self.start()

    def deployment(self):
        from workers.nemo_gym.deployment import resolve_sync

        return resolve_sync(self.head_url)


def _set_up_or_skip() -> None:
    """nemo-gym's venv, built once (scripts/nemo_gym.sh setup); skip where no Python >= 3.12 exists."""
    res = _script("python")
    if res.returncode == 3:
        pytest.skip(res.stderr.strip() or "no Python >= 3.12 for nemo-gym")
    setup = _script("setup", timeout=1200)
    if setup.returncode != 0:
        raise RuntimeError(f"scripts/nemo_gym.sh setup failed:\n{setup.stderr[-4000:]}")


def _serving(sim, ng):
    """NeMo Gym's servers started for a fixture's tests, then stopped with the simulator behind them."""
    try:
        ng.start()
        yield ng
    finally:
        ng.stop()
        sim.stop()


@pytest.fixture(scope="session")
def nemo_gym_session():
    _set_up_or_skip()
    # every arithmetic answer right: a reward then depends only on the row (its expected_answer), so two
    # collections of the same file agree row by row
    sim = start_simulator(ttft_ms=0, itl_ms=0, jitter=0, seed=0, math_accuracy=1.0)
    ng = NemoGym(sim, tempfile.mkdtemp(prefix="nemo-gym-run-"))
    yield from _serving(sim, ng)


@pytest.fixture
def nemo_gym(nemo_gym_session):
    """The session's ng_run in its plain configuration: a test that served with another (ng_run's profiling on)
    leaves it so, and the next test that asks for it restarts it (~1 min), not the test itself: the last
    such test of a run costs no restart."""
    nemo_gym_session.configure({})
    return nemo_gym_session


@pytest.fixture(scope="module")
def nemo_gym_tools():
    _set_up_or_skip()
    sim = start_simulator(ttft_ms=20, itl_ms=2, jitter=0, seed=0, math_accuracy=1.0)
    ng = NemoGym(sim, tempfile.mkdtemp(prefix="nemo-gym-tools-run-"))
    # the first start builds the tool agent's server venvs too (uv; a few minutes on a busy machine)
    ng.extra_env = {"NEMO_GYM_EXTRA_CONFIGS": f"{SECOND_AGENT_CONFIG},{VERIFIER_CONFIG},{TOOL_AGENT_CONFIG}",
                    "NEMO_GYM_START_TIMEOUT": "1200"}
    yield from _serving(sim, ng)
