"""The code-execution verifier's sandbox: hostile programs fail their test with a clear reason and never
harm the worker; correct and wrong programs are scored right; many runs leave nothing behind."""
from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from workers.verifiers import sandbox, verify_row

NS = sandbox.mode()[0] == "bubblewrap"
needs_namespaces = pytest.mark.skipif(not NS, reason=f"namespaces refused here: {sandbox.mode()[1]}")
REPO = Path(__file__).resolve().parents[2]
ADD = {"verifier_metadata": {"unit_tests": {"inputs": ["1 2\n", "40 2\n"], "outputs": ["3\n", "42\n"]}}}
FAST = {"cpu_s": 1, "wall_s": 4}


def code(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\n"


def run(program, row=ADD, **options):
    return verify_row("code", row, code(program), {**FAST, **options})


@pytest.mark.slow
def test_correct_and_wrong_programs_are_scored_right():
    ok = run("a, b = map(int, input().split())\nprint(a + b)")
    assert ok.reward == 1.0 and ok.fields["tests_passed"] == 2 and ok.fields["failure_reason"] == ""
    wrong = run("a, b = map(int, input().split())\nprint(a * b)")
    assert wrong.reward == 0.0 and wrong.fields["failure_reason"] == "test 1: wrong output"
    half = run("a, b = map(int, input().split())\nprint(42 if a == 40 else 0)", partial_credit=True, stop_on_failure=False)
    assert half.reward == 0.5 and half.fields["tests_passed"] == 1


@pytest.mark.slow
def test_assertion_style_tests():
    row = {"verifier_metadata": {"unit_tests": {"asserts": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}}}
    assert run("def add(a, b):\n    return a + b", row).reward == 1.0
    bad = run("def add(a, b):\n    return a - b", row)
    assert bad.reward == 0.0 and "AssertionError" in bad.fields["failure_reason"]


def _worker_alive_check():
    assert verify_row("code", ADD, code("print(sum(map(int, input().split())))"), FAST).reward == 1.0


@pytest.mark.slow
@needs_namespaces
def test_fork_bomb_fails_its_test_and_leaves_no_process():
    t = time.monotonic()
    res = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert res.reward == 0.0
    assert any(w in res.fields["failure_reason"] for w in ("wall-clock", "CPU-time", "Resource temporarily unavailable", "exited"))
    assert time.monotonic() - t < 30
    _worker_alive_check()


@pytest.mark.slow
def test_infinite_loop_is_stopped():
    res = run("while True:\n    pass")
    assert res.reward == 0.0
    assert "CPU-time limit exceeded" in res.fields["failure_reason"] or "wall-clock limit exceeded" in res.fields["failure_reason"]


@pytest.mark.slow
def test_memory_bomb_is_refused():
    res = run("x = bytearray(8 * 1024 ** 3)\nprint(len(x))")
    assert res.reward == 0.0 and "memory limit exceeded" in res.fields["failure_reason"]
    _worker_alive_check()


@pytest.mark.slow
def test_output_flood_is_cut():
    res = run("while True:\n    print('x' * 1000)", output_bytes=100_000)
    assert res.reward == 0.0 and "output-size limit exceeded" in res.fields["failure_reason"]


@pytest.mark.slow
@needs_namespaces
def test_socket_cannot_reach_anything():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        res = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint(1 + 2)\nprint(42)")
    finally:
        server.close()
    assert res.reward == 0.0 and ("Connection refused" in res.fields["failure_reason"]
                                  or "unreachable" in res.fields["failure_reason"])


@pytest.mark.slow
@needs_namespaces
def test_project_files_are_invisible():
    settings = REPO / "controlplane" / "settings.py"
    assert settings.exists()
    res = run(f"print(open({str(settings)!r}).read()[:20])")
    assert res.reward == 0.0 and "FileNotFoundError" in res.fields["failure_reason"]
    res = run("import os\nprint(os.listdir('/'))\nprint(42)")
    assert res.reward == 0.0  # runs, but wrong output; and nothing of the host's tree is listed:
    out = sandbox.run_python("import os\nprint(sorted(os.listdir('/')))")
    assert out.status == "ok" and "'work'" in out.stdout and "'root'" not in out.stdout and "'etc'" not in out.stdout
    out = sandbox.run_python(f"import os\nprint(os.path.exists({str(REPO)!r}))")
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_environment_secrets_are_invisible(monkeypatch):
    monkeypatch.setenv("VERIFIER_TEST_SECRET", "hunter2-do-not-leak")
    program = ("import os, sys\nsecret = os.environ.get('VERIFIER_TEST_SECRET')\n"
               "assert secret is None, 'secret visible'\nprint(3)\nprint(42)")
    res = run(program, {"verifier_metadata": {"unit_tests": {"inputs": [""], "outputs": ["3\n42"]}}})
    assert res.reward == 1.0  # the program ran, and the secret was not there
    leak = sandbox.run_python("import os\nprint(dict(os.environ))")
    assert "hunter2" not in leak.stdout and "DATABASE_URL" not in leak.stdout
    res = run("import os\nprint(os.environ['VERIFIER_TEST_SECRET'])")
    assert res.reward == 0.0 and "KeyError" in res.fields["failure_reason"]


@pytest.mark.slow
def test_reports_the_sandbox_in_use():
    res = run("print(3)")
    assert res.fields["sandbox"] == ("bubblewrap" if NS else f"rlimits only ({sandbox.mode()[1]})")


def _sandbox_processes() -> list[int]:
    """Processes that belong to a sandbox run: bwrap, or a throwaway uid."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{pid}")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if sandbox._UID_BASE <= st.st_uid < sandbox._UID_BASE + sandbox._UID_SPAN or b"main.py" in cmd and b"-I" in cmd:
            out.append(int(pid))
    return out


def _temp_dirs() -> set[str]:
    import tempfile
    return {p.name for p in Path(tempfile.gettempdir()).glob("verify-*")}


@pytest.mark.slow
def test_500_programs_32_in_parallel_leave_nothing_behind():
    before_dirs = _temp_dirs()
    programs = []
    for i in range(500):
        kind = i % 5
        if kind == 0:
            programs.append(("a, b = map(int, input().split())\nprint(a + b)", 1.0))
        elif kind == 1:
            programs.append(("print(0)", 0.0))
        elif kind == 2:
            programs.append(("import time\ntime.sleep(60)", 0.0))  # killed at the wall limit
        elif kind == 3:
            programs.append(("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                             "a, b = map(int, input().split())\nprint(a + b)", 1.0))  # leaves a child behind
        else:
            programs.append(("x = bytearray(8 * 1024 ** 3)", 0.0))
    with ThreadPoolExecutor(32) as ex:
        results = list(ex.map(lambda p: run(p[0], wall_s=2), programs))
    assert [r.reward for r in results] == [want for _, want in programs]
    assert _sandbox_processes() == []  # run_python returns only once its processes are gone
    assert _temp_dirs() - before_dirs == set()
