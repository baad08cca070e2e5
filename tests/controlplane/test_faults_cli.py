"""The drop-in CLI (manage.py collect_rollouts) SIGKILLed mid-run leaves no verifier-pool process behind
(before: the forkserver and its pool processes idled on for good), and a rerun completes exactly once."""
from __future__ import annotations

import signal
import time

import psutil
import pytest

from controlplane.jobs.models import JobState

from .test_collect_rollouts import _start_cli, _wait_rows, assert_exactly_once, cli_args, write_math


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_sigkilled_cli_leaves_no_verifier_pool_process(simulator_factory, tmp_path):
    n_tasks, repeats = 60, 2
    sim = simulator_factory(ttft_ms=40, itl_ms=2)
    inp = write_math(tmp_path / "tasks.jsonl", n_tasks)
    args = cli_args(inp, tmp_path / "rollouts.jsonl", sim.url, "+num_samples_in_parallel=4", "+chunk_size=20",
                    "+verifier=math")
    with open(tmp_path / "run1.log", "w") as log:
        cli = _start_cli(args, log, JOBS_LEASE_TIMEOUT_S="2", JOBS_FLUSH_ROWS="4", VERIFY_POOL_PROCESSES="2")
        try:
            job = _wait_rows({"name": "cli: math_agent"}, 12, cli)
            children = psutil.Process(cli.pid).children(recursive=True)
            pool = [p for p in children if "forkserver" in " ".join(p.cmdline())]
            assert len(pool) >= 3, [p.cmdline() for p in children]  # the fork server and two verifier processes
            cli.send_signal(signal.SIGKILL)
            assert cli.wait(timeout=10) == -signal.SIGKILL
            t0 = time.monotonic()
            _, alive = psutil.wait_procs(children, timeout=5)
            print(f"\n{len(children)} child processes of the killed CLI, all gone {time.monotonic() - t0:.1f}s after")
            assert not alive, [(p.pid, " ".join(p.cmdline())[:100]) for p in alive]
        finally:
            if cli.poll() is None:
                cli.kill()

    with open(tmp_path / "run2.log", "w") as log:
        rerun = _start_cli(args, log, JOBS_LEASE_TIMEOUT_S="2")
        assert rerun.wait(timeout=120) == 0, (tmp_path / "run2.log").read_text()
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED
    assert_exactly_once(job, n_tasks * repeats)
