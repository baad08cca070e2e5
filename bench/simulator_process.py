"""The built-in simulator as a subprocess of a bench: `python -m workers.simulator` on a free port, its URL read
from the ready line it prints."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_simulator_process(*flags, **popen_kwargs) -> tuple[subprocess.Popen, str]:
    """Start the simulator with `flags` (its command-line options, any value turned into a string); returns the
    process and its base URL. popen_kwargs go to Popen (stderr, env, preexec_fn)."""
    proc = subprocess.Popen([sys.executable, "-m", "workers.simulator", "--host", "127.0.0.1", "--port", "0",
                             *map(str, flags)], cwd=REPO, stdout=subprocess.PIPE, text=True, **popen_kwargs)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"simulator did not start: {line!r}")
    return proc, "http://" + line.split("http://", 1)[1].split()[0].rstrip("/")
