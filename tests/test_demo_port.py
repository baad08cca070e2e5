"""`make demo` with its web port taken by another program: one line naming the port and the variable to
change, quickly, and nothing of the demo left running."""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _hold(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None  # someone else holds it already: taken all the same
    s.listen(1)
    return s


def _demo_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", f"{REPO}/.venv/bin/(uvicorn|celery)|workers.simulator --host 127.0.0.1 --port 8100"],
                         capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


@pytest.mark.parametrize("port, var", [(8000, "WEB_PORT")])
def test_make_demo_with_the_web_port_taken(port, var):
    run_dir = REPO / "var" / "run"
    if any((run_dir / f"{n}.pid").exists() for n in ("web", "simulator")):
        pytest.skip("a demo of this checkout is running")
    held = _hold(port)
    if held is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                pytest.skip(f"port {port} can be neither held nor reached")
    before = _demo_pids()
    try:
        t0 = time.monotonic()
        r = subprocess.run(["make", "-s", "demo"], cwd=REPO, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    finally:
        if held is not None:
            held.close()
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0
    ours = [x for x in err if not x.startswith("make")]  # make's own "Error 1" line aside
    assert len(ours) == 1, r.stderr  # one line ...
    assert f"port {port}" in ours[0] and var in ours[0] and "in use" in ours[0], ours  # ... naming both
    assert took < 20, took  # not 40 s of "web did not answer"
    assert not any((run_dir / f"{n}.pid").exists() for n in ("web", "worker", "beat", "simulator"))
    assert _demo_pids() <= before  # nothing of the demo started
