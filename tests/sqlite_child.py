"""Run a piece of Django code in a child process on a fresh SQLite file (the laptop default), for the tests
that show a figure on SQLite while the suite itself runs on PostgreSQL. The child prints one line
`RESULT <json>`; its value is returned."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.fixtures_simulator import REPO_ROOT


def run_on_sqlite(code: str, tmp_path, timeout: float = 300):
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path}/laptop.sqlite3",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "PYTHONPATH": str(REPO_ROOT)}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    out = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert out, p.stderr[-3000:]
    return json.loads(out[0][len("RESULT "):])
