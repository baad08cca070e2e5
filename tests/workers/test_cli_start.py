"""The collection command's fast start (workers/cli_start.py, issue 28): which runs warm the verifier pool while
Django sets up, and that the pool it warms is the one the engine then uses without waiting."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import pytest

from workers import cli_start
from workers.engine.verify_pool import VerifyBatcher, VerifyPool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_only_runs_that_verify_in_the_pool_warm_it(monkeypatch):
    started = []
    monkeypatch.setattr(cli_start, "_warm", lambda *a: started.append(a))
    assert cli_start.prewarm_from_argv(["manage.py", "migrate"]) is None
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "--help"]) is None
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+verify_mode=deferred"]) is None
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+agent_name=a"]) is None  # agents verify
    t = cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+input_jsonl_fpath=x", "+verifier=exact"])
    t.join(5)
    assert started == [("exact", None, False)]


def test_an_engine_run_does_not_wait_for_a_pool_being_warmed():
    pool = VerifyPool()
    try:
        executor = pool.executor(1)
        executor._engine_warming = True  # what prewarm() sets while its warm-up runs
        loop = asyncio.new_event_loop()
        try:
            batcher = VerifyBatcher(loop, 1, pool=pool)
            stop = asyncio.Event()
            loop.run_until_complete(asyncio.wait_for(batcher.warm("math", stop, logging.getLogger("t")), 1.0))
        finally:
            loop.close()
        pool.prewarm("exact", 1)
        assert getattr(pool.executor(1), "_engine_warm", False)
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_the_command_still_exits_with_its_status_and_message():
    p = subprocess.run([sys.executable, "manage.py", "collect_rollouts", "+no_such_key=1"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "no_such_key" in p.stderr
