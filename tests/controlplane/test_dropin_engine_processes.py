"""`collect_rollouts +engine_processes=N` (controlplane.jobs.engine_procs): one job's chunks run in N processes on
this host, shared by lease; the output files still hold exactly one line per rollout; SIGTERM stops the
children too (the job paused); a rerun resumes; a child killed mid-chunk leaves its chunk to the command;
the SQLite default takes the concurrent writers."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import psutil
import pytest
from django.core.management import call_command

from controlplane.jobs.dropin_args import ArgError, idempotency_key, parse_overrides
from controlplane.jobs.models import CollectionJob, JobChunk, JobState, Rollout

from .test_collect_rollouts import (
    BASE, REPO, _fresh_checkout_env, _start_cli, _wait_rows, assert_exactly_once, check_output, cli_args, write_math,
)


@pytest.mark.parametrize("value, fragment", [
    ("0", "+engine_processes must be >= 1, got 0"),
    ("two", "+engine_processes must be an integer"),
    ("1.5", "+engine_processes must be an integer"),
    ("65", "+engine_processes must be <= 64, got 65"),
])
def test_bad_engine_processes_is_a_clear_error(value, fragment):
    with pytest.raises(ArgError) as ei:
        parse_overrides(BASE + [f"+engine_processes={value}"])
    assert fragment in str(ei.value)


def test_engine_processes_is_not_part_of_the_jobs_identity():
    one, two = parse_overrides(BASE), parse_overrides(BASE + ["+engine_processes=2"])
    assert one["engine_processes"] == 1 and two["engine_processes"] == 2
    assert idempotency_key(one, "sha", {}) == idempotency_key(two, "sha", {})  # rerun with another N resumes


def _lines(out) -> list[tuple[int, int]]:
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in map(json.loads, out.read_text().splitlines())]


def _pids(owners) -> set[str]:
    return {o.split(":")[1] for o in owners if o}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_two_processes_share_the_chunks_and_write_each_rollout_once(simulator_factory, tmp_path, capsys):
    # ~12 s of requests in one process (120 rollouts, 4 in flight, 400 ms each): the child (spawned, Django set up)
    # is taking chunks long before the command's process could have run them all
    sim = simulator_factory(ttft_ms=400, itl_ms=0, jitter=0, seed=0)
    inp = write_math(tmp_path / "tasks.jsonl", 60)
    out = tmp_path / "rollouts.jsonl"
    call_command("collect_rollouts", *cli_args(inp, out, sim.url, "+num_samples_in_parallel=4",
                                               "+engine_processes=2"))
    captured = capsys.readouterr()
    assert "Engine processes: 2 (this one and 1 more), 4 chunk(s) to run" in captured.err
    assert "120 ok, 0 failed of 120" in captured.out
    job = CollectionJob.objects.get()
    assert job.state == JobState.COMPLETED and job.chunk_size == 15  # chunk_size unset: 2 chunks per process
    assert_exactly_once(job, 120)
    rows, _ = check_output(out, 60, 2)
    stored = set(Rollout.objects.filter(job=job).values_list("task_index", "rollout_index"))
    assert len(_lines(out)) == len(set(_lines(out))) == len(stored) and set(_lines(out)) == stored
    # both processes ran chunks and stored rollouts: the command's (pid of this test) and a child's
    owners = list(JobChunk.objects.filter(job=job).values_list("lease_owner", flat=True))
    workers = set(Rollout.objects.filter(job=job).values_list("worker", flat=True))
    assert len(_pids(owners)) == 2 and len(_pids(workers)) == 2, (owners, workers)
    assert str(os.getpid()) in _pids(owners)
    assert any(":engine1:" in w for w in workers)
    line = next(x for x in captured.out.splitlines() if x.startswith("Engine processes: 2; rollouts stored"))
    counts = [int(c) for c in line.split(": ")[-1].split(" (")[0].split(", ")]
    assert sum(counts) == 120 and all(counts), line
    assert not psutil.Process().children(recursive=False) or all(
        "spawn_main" not in " ".join(c.cmdline()) for c in psutil.Process().children())  # the child ended


N_TASKS, REPEATS = 60, 2


def _slow_two_process_args(simulator_factory, tmp_path):
    """A 60-task job at 300 ms per request (~9 s in one process: the child starts in time) for two processes:
    (the output file, the command's arguments)."""
    sim = simulator_factory(ttft_ms=300, itl_ms=0, jitter=0, seed=0)
    inp = write_math(tmp_path / "tasks.jsonl", N_TASKS)
    out = tmp_path / "rollouts.jsonl"
    return out, cli_args(inp, out, sim.url, "+num_samples_in_parallel=4", "+engine_processes=2")


def _wait_for(condition, proc, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline and proc.poll() is None, what
        time.sleep(poll_s)


def _spawned_children(pid: int) -> list:
    return [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sigterm_stops_every_process_then_a_rerun_resumes_exactly_once(simulator_factory, tmp_path):
    n_tasks, repeats = N_TASKS, REPEATS
    out, args = _slow_two_process_args(simulator_factory, tmp_path)
    with open(tmp_path / "run1.log", "w") as log:
        p1 = _start_cli(args, log, JOBS_FLUSH_ROWS="2")
        try:
            job = _wait_rows({"name": "cli: math_agent"}, 1, p1)
            _wait_for(JobChunk.objects.filter(job=job, state=JobChunk.State.RUNNING,
                                              lease_owner__contains=":engine1:").exists, p1, "the child never took a chunk")
            children = _spawned_children(p1.pid)
            assert len(children) == 1
            p1.send_signal(signal.SIGTERM)  # the command only: it passes it on
            rc = p1.wait(timeout=60)
        finally:
            if p1.poll() is None:
                p1.kill()
    log1 = (tmp_path / "run1.log").read_text()
    assert rc == 130, log1
    assert "Rerun the same command to resume" in log1
    psutil.wait_procs(children, timeout=10)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), "child left running"
    job.refresh_from_db()
    assert job.state == JobState.PAUSED
    assert not JobChunk.objects.filter(job=job, state=JobChunk.State.RUNNING).exists()  # every lease given back
    first = Rollout.objects.filter(job=job).count()
    assert 0 < first < n_tasks * repeats
    lines = out.read_text().splitlines()
    stored = set(Rollout.objects.filter(job=job, status=Rollout.Status.OK).values_list("task_index", "rollout_index"))
    assert len(_lines(out)) == len(set(_lines(out))) and set(_lines(out)) == stored  # the child's rows too

    with open(tmp_path / "run2.log", "w") as log:
        p2 = _start_cli(args, log)
        rc2 = p2.wait(timeout=120)
    log2 = (tmp_path / "run2.log").read_text()
    assert rc2 == 0, log2
    assert f"Job {job.pk}: resuming" in log2 and "lease to expire" not in log2
    assert CollectionJob.objects.count() == 1
    assert_exactly_once(job, n_tasks * repeats)
    check_output(out, n_tasks, repeats)
    assert out.read_text().splitlines()[:len(lines)] == lines  # appended only what was new


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_killed_child_leaves_its_chunk_to_the_command(simulator_factory, tmp_path):
    n_tasks, repeats = N_TASKS, REPEATS
    out, args = _slow_two_process_args(simulator_factory, tmp_path)
    with open(tmp_path / "run.log", "w") as log:
        # a lease timeout far longer than the run: the chunk comes back through the command, not lease expiry
        p = _start_cli(args, log, JOBS_FLUSH_ROWS="2", JOBS_LEASE_TIMEOUT_S="600")
        try:
            job = _wait_rows({"name": "cli: math_agent"}, 1, p)
            _wait_for(Rollout.objects.filter(job=job, worker__contains=":engine1:").exists, p,
                      "the child never stored a rollout", poll_s=0.05)
            child = _spawned_children(p.pid)[0]
            child.kill()
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    log_text = (tmp_path / "run.log").read_text()
    assert rc == 0, log_text
    assert "ended (exit -9) holding it; run here instead" in log_text, log_text  # not by the lease's expiry
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED
    assert_exactly_once(job, n_tasks * repeats)
    check_output(out, n_tasks, repeats)  # the dead child's rows are in the file once each


@pytest.mark.slow
def test_two_processes_on_the_sqlite_default(simulator_factory, tmp_path):
    sim = simulator_factory(ttft_ms=400, itl_ms=0, jitter=0, seed=0)  # ~12 s in one process: the child starts in time
    inp = write_math(tmp_path / "tasks.jsonl", 60)
    out = tmp_path / "rollouts.jsonl"
    var = tmp_path / "var"
    cmd = [sys.executable, "manage.py", "collect_rollouts", *cli_args(inp, out, sim.url, "+num_samples_in_parallel=4",
                                                                     "+engine_processes=2", "+chunk_size=5")]
    proc = subprocess.run(cmd, cwd=REPO, env=_fresh_checkout_env(var, JOBS_FLUSH_ROWS="2"), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Engine processes: 2 (this one and 1 more), 12 chunk(s) to run" in proc.stderr
    check_output(out, 60, 2)
    with sqlite3.connect(var / "controlplane.sqlite3") as db:
        rows = db.execute("SELECT task_index, rollout_index, worker FROM jobs_rollout").fetchall()
    assert sorted((t, k) for t, k, _ in rows) == sorted(_lines(out)) == [(t, k) for t in range(60) for k in range(2)]
    assert len(_pids(w for _, _, w in rows)) == 2  # both processes wrote the file-backed database
