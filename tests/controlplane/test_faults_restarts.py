"""Restarts of the databases under a running job, with real processes, on private servers (tests/private_servers.py):
restarting them disturbs nothing else. Each test ends with the exact row count and no duplicates."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.private_servers import PrivatePostgres, Unavailable

from .test_collect_rollouts import cli_args, write_math

REPO = Path(__file__).resolve().parents[2]


def _count(pg_url: str, sql: str):
    import psycopg

    try:
        with psycopg.connect(pg_url, connect_timeout=2) as conn:
            return conn.execute(sql).fetchone()
    except psycopg.OperationalError:
        return None  # down (being restarted) or the table not there yet


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_postgres_restarted_mid_job_loses_and_doubles_nothing(simulator_factory, tmp_path):
    n_tasks, repeats = 300, 2
    try:
        pg = PrivatePostgres(tmp_path)
        pg.start()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        pg.create_database("cp")
        url = pg.url("cp")
        env = {**os.environ, "DATABASE_URL": url, "PYTHONUNBUFFERED": "1", "JOBS_FLUSH_ROWS": "20",
               "JOBS_LEASE_TIMEOUT_S": "60", "VERIFY_POOL_PROCESSES": "1"}
        migrate = subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=180)
        assert migrate.returncode == 0, migrate.stderr
        sim = simulator_factory(seed=5, ttft_ms=80, itl_ms=3, output_len_min=8, output_len_max=24)
        inp = write_math(tmp_path / "tasks.jsonl", n_tasks)
        out = tmp_path / "rollouts.jsonl"
        args = cli_args(inp, out, sim.url, "+num_samples_in_parallel=16", "+chunk_size=100", "+verifier=exact")
        log_path = tmp_path / "cli.log"
        with open(log_path, "w") as log:
            cli = subprocess.Popen([sys.executable, "manage.py", "collect_rollouts", *args], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
            try:
                restarts = []
                for threshold in (120, 330):  # two restarts: mid-chunk, and later in another chunk
                    deadline = time.monotonic() + 90
                    while True:
                        row = _count(url, "SELECT count(*) FROM jobs_rollout")
                        if row and row[0] >= threshold:
                            break
                        assert cli.poll() is None, "CLI exited early:\n" + log_path.read_text()[-3000:]
                        assert time.monotonic() < deadline, "no progress:\n" + log_path.read_text()[-3000:]
                        time.sleep(0.1)
                    pg.restart(down_s=2.0)
                    restarts.append(row[0])
                rc = cli.wait(timeout=150)
            finally:
                if cli.poll() is None:
                    cli.kill()
        text = log_path.read_text()
        assert rc == 0, text[-4000:]
        assert restarts[-1] < n_tasks * repeats, "the job finished before the restart: slow the simulator down"
        assert "database error" in text and "retrying" in text, text[-4000:]  # the retry path really ran
        total, distinct = _count(url, "SELECT count(*), count(DISTINCT (task_index, rollout_index)) FROM jobs_rollout")
        state, completed, failed = _count(url, "SELECT state, completed_count, failed_count FROM jobs_collectionjob")
        print(f"\nrestarts at {restarts} rows; final {total} rows, {distinct} distinct; job {state} "
              f"{completed} ok + {failed} failed")
        assert total == distinct == n_tasks * repeats  # none lost, none doubled
        assert state == "completed" and completed + failed == n_tasks * repeats
        assert sum(1 for _ in open(out)) == completed
    finally:
        pg.destroy()
