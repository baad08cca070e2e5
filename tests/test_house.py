"""House rules the suite enforces: the linter is clean, the models match their migrations, the apps import
downward only and no product module is over 700 lines."""
from __future__ import annotations

import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.django_db
def test_every_model_change_has_its_migration():
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exit_:
        raise AssertionError(f"models changed without a migration:\n{out.getvalue()}") from exit_


def test_apps_import_downward_only():
    """import-linter's contracts in pyproject.toml: the layers of the apps (function-level imports included)
    and a Django-free engine."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


MAX_MODULE_LINES = 700
PRODUCT = ("controlplane", "workers", "rolloutctl", "bench", "scripts")


def test_no_product_module_over_700_lines():
    """A module that grows past 700 lines is split along a seam (a room whose name says what it holds)."""
    long = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            with path.open(encoding="utf-8") as f:
                n = sum(1 for _ in f)
            if n > MAX_MODULE_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
