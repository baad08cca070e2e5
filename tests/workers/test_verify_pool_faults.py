"""Verifier-pool faults with real processes: a verifier that kills its own process, and a pool owner that is
SIGKILLed (its pool processes must not outlive it)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest

from workers.engine.materialize import materialize
from workers.engine.runner import run_collection
from workers.engine.types import FailureClass
from workers.engine.verify_pool import VerifyPool

from .test_engine import ListSink, spec_for

REPO = Path(__file__).resolve().parents[2]
CRASHING = {7, 23, 24}


def _rows(n):
    for i in range(n):
        yield i, {"responses_create_params": {"input": [{"role": "user", "content": f"row {i}"}]},
                  "crash_verifier": i in CRASHING}


@pytest.mark.slow
async def test_a_verifier_that_kills_its_process_fails_only_its_rows_and_the_job_goes_on(simulator):
    pool = VerifyPool()
    try:
        sink = ListSink()
        spec = spec_for(simulator, parallelism=16, verifier="tests.verifier_plugins:crash_when_flagged",
                        verify_processes=2, responses_create_params={"max_output_tokens": 8})
        summary = await run_collection(spec, materialize(_rows(60), 2), sink, verify_pool=pool)
        assert not summary.fatal_error
        pairs = Counter((r.task_index, r.rollout_index) for r in sink.results)
        assert len(sink.results) == 120 and len(pairs) == 120 and max(pairs.values()) == 1  # none lost, none doubled
        failed = {(r.task_index, r.rollout_index): r for r in sink.results if not r.ok}
        assert set(failed) == {(t, k) for t in CRASHING for k in range(2)}, sorted(failed)
        for r in failed.values():
            assert r.failure_class == FailureClass.VERIFIER_ERROR
            assert "VerifierCrashed" in r.error and "verifier process died" in r.error, r.error
            # the code it exited with, as the fork server reported it (CPython says 255 when the fork server could
            # not report a child's status; the culprit was still found by verifying each suspect alone)
            assert re.search(r"\(exit code (3|255|unknown)\)", r.error), r.error
        assert all(r.reward == 1.0 for r in sink.results if r.ok)  # innocent neighbours of a crash were verified
        # the pool was rebuilt and still works
        assert pool.executor(2).submit(os.getpid).result(timeout=30) > 0
    finally:
        pool.shutdown()


OWNER_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from workers.engine.verify_pool import VerifyPool, _warm_verifier
if __name__ == "__main__":
    pool = VerifyPool()
    ex = pool.executor(2)
    pids = list(ex.map(_warm_verifier, ["exact", "exact"]))
    print("READY", flush=True)
    time.sleep(600)
"""


def _descendants(pid):
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigkilled_pool_owner_leaves_no_pool_process_behind(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER_SCRIPT.format(repo=str(REPO)))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "READY"
        children = _descendants(owner.pid)
        assert len(children) >= 3  # fork server (+ resource tracker) and two pool processes
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [(p.pid, p.cmdline()[-1][:80]) for p in alive]
    finally:
        if owner.poll() is None:
            owner.kill()
        for p in _descendants(os.getpid()):
            if p.pid != owner.pid and "forkserver" in " ".join(p.cmdline()):
                pass  # the test process's own pools are not ours to stop
