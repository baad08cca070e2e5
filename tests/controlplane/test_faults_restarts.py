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
from tests.lanes import serve_control

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


class GroupListener:
    """Subscribes to a job's group on a channel layer, in a thread with its own event loop (the pub/sub layer
    is bound to one loop), and keeps every message it receives, as a dashboard consumer would."""

    def __init__(self, hosts, prefix, group):
        import asyncio
        import threading

        self.messages: list[dict] = []
        self.subscribed = threading.Event()
        self._stop = False
        self._args = (hosts, prefix, group)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)
        self._thread.start()
        assert self.subscribed.wait(15), "could not subscribe to the channel layer"

    async def _run(self):
        import asyncio

        from channels_redis.pubsub import RedisPubSubChannelLayer

        hosts, prefix, group = self._args
        layer = RedisPubSubChannelLayer(hosts=hosts, prefix=prefix)
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        self.subscribed.set()
        try:
            while not self._stop:
                try:
                    self.messages.append(await asyncio.wait_for(layer.receive(channel), 1.0))
                except asyncio.TimeoutError:
                    pass
                except Exception:  # noqa: BLE001  (Redis down: the layer reconnects; keep listening)
                    await asyncio.sleep(0.2)
        finally:
            await layer.flush()

    def stop(self):
        self._stop = True
        self._thread.join(10)


def _redis_restart_run(user, math_dataset, sim_endpoint, simulator_factory, tmp_path, *, keep_data):
    """A real Celery worker (threads pool, 2 slots) and beat run a 6-chunk job from a private Redis (broker and
    channel layer); Redis is restarted once 150 rows are stored and chunks still wait in its queue (shut down
    with SAVE, or killed with nothing saved: keep_data), down 2 s. Returns what the test asserts on."""
    import uuid

    from celery import Celery
    from django.db.models import Count

    from controlplane.jobs import services
    from controlplane.jobs.events import job_group
    from controlplane.jobs.models import JobState, Rollout

    from tests.private_servers import PrivateRedis

    from .test_jobs_e2e import Proc, _database_url

    n_tasks, repeats = 600, 2
    try:
        redis = PrivateRedis(tmp_path)
        redis.start()
    except Unavailable as exc:
        pytest.skip(str(exc))
    sim = simulator_factory(seed=3, ttft_ms=100, itl_ms=3, output_len_min=8, output_len_max=24)
    job = services.create_job(owner=user, dataset=math_dataset(n_tasks), endpoint=sim_endpoint(sim.url),
                              num_repeats=repeats, chunk_size=100, num_samples_in_parallel=16, launch=False)
    assert job.chunks.count() == 6
    queue = f"faults-redis-{uuid.uuid4().hex[:8]}"
    prefix = f"faults-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "REDIS_URL": redis.url(), "CELERY_BROKER_URL": redis.url(),
           "CELERY_TASK_DEFAULT_QUEUE": queue, "CHANNELS_PREFIX": prefix, "PYTHONUNBUFFERED": "1",
           "JOBS_FLUSH_ROWS": "20", "VERIFY_POOL_PROCESSES": "1", "JOBS_WATCHDOG_INTERVAL_S": "2",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    listener = GroupListener([redis.url()], prefix, job_group(job.pk))
    celery = [sys.executable, "-m", "celery", "-A", "controlplane"]
    worker = Proc("worker", [*celery, "worker", "-P", "threads", "-c", "2", "-Q", serve_control(queue), "-n", f"{queue}@%h",
                             "--without-gossip", "--without-mingle", "-l", "info"], env, tmp_path)
    beat = Proc("beat", [*celery, "beat", "-l", "info", "-s", str(tmp_path / "beat-schedule")], env, tmp_path)
    out = {}
    try:
        sender = Celery("faults-sender", broker=redis.url(), set_as_current=False)
        with sender.connection_for_write() as conn:
            for chunk_id in job.chunks.order_by("index").values_list("pk", flat=True):
                sender.send_task("controlplane.jobs.tasks.run_chunk_task", args=[chunk_id], queue=queue, connection=conn)
        job.chunks.update(dispatched_at=job.created_at)

        deadline = time.monotonic() + 90
        while Rollout.objects.filter(job=job).count() < 150:
            assert time.monotonic() < deadline, "no progress:\n" + worker.tail()
            assert worker.popen.poll() is None, "worker exited:\n" + worker.tail()
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while not listener.messages:
            assert time.monotonic() < deadline, "no progress message before the restart"
            time.sleep(0.1)
        import redis as redis_client

        # The simulator holds every request across the restart, so the job cannot finish before the
        # listener's subscription is back (on a loaded machine it once did, and the test saw no message).
        sim.configure(hang=True)
        redis.restart(down_s=2.0, keep_data=keep_data)
        restarted = time.monotonic()
        before = len(listener.messages)
        out["at_restart"] = at_restart = Rollout.objects.filter(job=job).count()
        out["pending_at_restart"] = job.chunks.filter(state="pending").count()
        new_redis = redis_client.Redis.from_url(redis.url())
        out["queued_after_restart"] = new_redis.llen(queue)
        deadline = time.monotonic() + 30
        while not new_redis.pubsub_channels(f"{prefix}__group__*"):
            assert time.monotonic() < deadline, "the listener did not subscribe again after the restart"
            time.sleep(0.1)
        sim.configure(hang=False)
        # the same subscription gets the worker's progress again (both sides reconnected to the new Redis)
        deadline = time.monotonic() + 30
        while not any(m.get("completed", 0) + m.get("failed", 0) > at_restart for m in listener.messages[before:]):
            assert time.monotonic() < deadline, ("no progress message after the restart "
                                                 f"({len(listener.messages) - before} since):\n" + worker.tail())
            time.sleep(0.2)
        deadline = time.monotonic() + 100
        while True:
            job.refresh_from_db()
            if job.state not in (JobState.QUEUED, JobState.RUNNING):
                break
            assert time.monotonic() < deadline, "job did not finish:\n" + worker.tail() + "\nbeat:\n" + beat.tail()
            time.sleep(0.3)
        out["finished_after_s"] = time.monotonic() - restarted
    finally:
        beat.stop()
        worker.stop()
        listener.stop()
        redis.stop(save=False)
    rows = Rollout.objects.filter(job=job)
    out.update(job=job, expected=n_tasks * repeats, total=rows.count(), log=worker.log_path.read_text(errors="replace"),
               dupes=rows.values("task_index", "rollout_index").annotate(n=Count("id")).filter(n__gt=1).count(),
               pairs=set(rows.values_list("task_index", "rollout_index")),
               all_pairs={(t, r) for t in range(n_tasks) for r in range(repeats)})
    print(f"\nrestart ({'saved' if keep_data else 'nothing saved'}) at {at_restart} rows, {out['pending_at_restart']} "
          f"chunks pending, {out['queued_after_restart']} messages queued after it; finished {out['finished_after_s']:.1f} s "
          f"after it with {out['total']} rows, {out['dupes']} duplicated; job {job.state}; chunk attempts "
          f"{list(job.chunks.order_by('index').values_list('attempts', flat=True))}")
    return out


def _assert_exactly_once(out):
    from controlplane.jobs.models import CollectionJob, JobState

    job = out["job"]
    assert out["at_restart"] < out["expected"] and out["pending_at_restart"] > 0, "no chunk was still queued at the restart"
    assert job.state == JobState.COMPLETED, job.error_message
    assert out["total"] == out["expected"] and out["dupes"] == 0
    assert out["pairs"] == out["all_pairs"]
    assert job.completed_count + job.failed_count == out["total"]
    assert CollectionJob.objects.get(pk=job.pk).chunks.filter(state="done").count() == 6
    assert "Connection to broker lost" in out["log"] or "Cannot connect to redis" in out["log"], out["log"][-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.django_db(transaction=True)
def test_redis_restarted_mid_job_workers_reconnect_and_nothing_is_lost(user, math_dataset, sim_endpoint,
                                                                       simulator_factory, tmp_path):
    """Redis shut down with SAVE mid-job: the worker reconnects, takes the chunks still queued (their messages
    survived), progress messages flow again on the same channel-layer subscription (what the dashboard's consumer
    relies on), and the job completes with exactly one row per (task, repeat)."""
    out = _redis_restart_run(user, math_dataset, sim_endpoint, simulator_factory, tmp_path, keep_data=True)
    assert out["queued_after_restart"] > 0  # the queued chunks came back with the data
    _assert_exactly_once(out)


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.django_db(transaction=True)
def test_redis_back_empty_mid_job_lost_chunks_are_sent_again(user, math_dataset, sim_endpoint, simulator_factory,
                                                             tmp_path):
    """Redis killed with nothing saved mid-job: the queued chunk messages are gone with it. The watchdog (beat)
    sees that the broker lost its data and sends every pending chunk of a running job again, while the chunks
    that were running go on; the job completes with exactly one row per (task, repeat), soon after the restart
    rather than after the lost-message timeout (4 x the lease timeout, 120 s)."""
    out = _redis_restart_run(user, math_dataset, sim_endpoint, simulator_factory, tmp_path, keep_data=False)
    assert out["queued_after_restart"] == 0  # the chunks still queued were really lost
    _assert_exactly_once(out)
    assert out["finished_after_s"] < 60
