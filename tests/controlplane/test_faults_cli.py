"""Verifier-pool faults through the job runtime: the drop-in CLI (manage.py collect_rollouts) SIGKILLed mid-run
leaves no verifier-pool process behind (before: the forkserver and its pool processes idled on for good) and a
rerun completes exactly once; a verifier that kills its own process fails only its rows, stored with a clear
error, and the job completes."""
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


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_verifier_that_kills_its_process_is_recorded_per_row_and_the_job_completes(user, math_dataset, sim_endpoint,
                                                                                     simulator_factory, settings):
    from django.db.models import Count

    from controlplane.jobs import runtime, services
    from controlplane.jobs.models import Rollout
    from tests.factories import math_rows

    settings.VERIFY_POOL_PROCESSES = 2
    settings.VERIFIER_PATH_MODULES = ["tests.verifier_plugins"]  # the operator lets users name its verifiers
    rows = math_rows(40)
    crashing = {5, 17, 18}
    for i in crashing:
        rows[i]["crash_verifier"] = True
    sim = simulator_factory(seed=2, ttft_ms=5, itl_ms=1, output_len_min=4, output_len_max=12)
    job = services.create_job(owner=user, dataset=math_dataset(rows=rows), endpoint=sim_endpoint(sim.url),
                              num_repeats=2, num_samples_in_parallel=8, verifier="tests.verifier_plugins:crash_when_flagged",
                              launch=False)
    job = runtime.run_job_inline(job)
    assert job.state == JobState.COMPLETED, job.error_message
    stored = Rollout.objects.filter(job=job)
    assert stored.count() == 80
    assert not stored.values("task_index", "rollout_index").annotate(n=Count("id")).filter(n__gt=1).exists()
    failed = stored.filter(status="failed")
    assert set(failed.values_list("task_index", flat=True)) == crashing and failed.count() == 6
    for error, failure_class in failed.values_list("error", "failure_class"):
        assert failure_class == "verifier_error"
        assert "VerifierCrashed" in error and "the verifier process died while verifying this rollout" in error, error
    assert job.completed_count == 74 and job.failed_count == 6
