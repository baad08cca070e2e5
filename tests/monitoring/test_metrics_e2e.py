"""/metrics after a real job run by TWO real Celery worker processes: every counter is the sum of both
processes' files (prometheus-client multi-process mode), and each figure equals what the database holds.

The workers write their counters into this test's own PROMETHEUS_MULTIPROC_DIR; the scrape (this process,
as a web process would) reads that directory. A simulator injecting HTTP 500s on 15 % of requests, with no
retries, gives failed rollouts whose class (http_5xx) must be counted exactly."""
from __future__ import annotations

import os
import re
import shutil
import sys
import subprocess
import time
import urllib.request
import uuid

import pytest
from django.db.models import Count, Sum
from django.test import Client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from controlplane.dashboard.heartbeat import alive_workers
from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobChunk, JobState, Rollout
from tests.controlplane.test_jobs_e2e import Proc
from tests.dashboard.servers import database_url, free_port
from tests.lanes import serve_control

N_TASKS, N_REPEATS, CHUNK = 600, 2, 100


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, frozenset(labels)): value} from an exposition, parsed by prometheus_client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed, name, **labels):
    return parsed.get((name, frozenset(labels.items())))


def scrape(settings, prom_dir) -> dict:
    settings.PROMETHEUS_MULTIPROC_DIR = str(prom_dir)
    r = Client().get("/metrics")  # REMOTE_ADDR 127.0.0.1: inside the default allow-list
    assert r.status_code == 200 and r["Content-Type"].startswith("text/plain; version="), r.content[:500]
    return samples(r.content.decode())


def fetch(url) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return samples(r.read().decode())


def per_process_files(prom_dir, tmp_path) -> dict[int, dict]:
    """{pid: that process's own samples}: each process's files collected on their own."""
    by_pid: dict[int, list] = {}
    for f in prom_dir.iterdir():
        m = re.fullmatch(r"(counter|histogram)_.+-(\d+)\.db", f.name)
        if m:
            by_pid.setdefault(int(m.group(2)), []).append(f)
    out = {}
    for pid, files in by_pid.items():
        one = tmp_path / f"one-{pid}"
        one.mkdir()
        for f in files:
            shutil.copy(f, one / f.name)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(one))
        out[pid] = samples(generate_latest(registry).decode())
    return out


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_metrics_after_a_real_job_on_two_worker_processes(user, math_dataset, sim_endpoint, simulator_factory,
                                                           tmp_path, settings):
    sim = simulator_factory(seed=5, ttft_ms=20, itl_ms=1, output_len_min=8, output_len_max=16,
                            fault_rates={"500": 0.15})
    job = services.create_job(owner=user, dataset=math_dataset(N_TASKS), endpoint=sim_endpoint(sim.url, max_retries=0),
                              num_repeats=N_REPEATS, chunk_size=CHUNK, num_samples_in_parallel=16, launch=False)
    n_chunks = job.chunks.count()
    assert n_chunks == N_TASKS // CHUNK

    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    queue = f"metrics-e2e-{uuid.uuid4().hex[:10]}"
    worker_port = free_port()  # both workers try it: the first binds and serves the host's files, the other goes on
    env = {"WORKER_METRICS_PORT": str(worker_port), **os.environ, "DATABASE_URL": database_url(settings.DATABASES["default"]),
           "CELERY_TASK_DEFAULT_QUEUE": queue, "PROMETHEUS_MULTIPROC_DIR": str(prom_dir), "PYTHONUNBUFFERED": "1",
           "WORKER_HEARTBEAT_INTERVAL_S": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    celery = [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "2", "-Q", serve_control(queue),
              "--without-gossip", "--without-mingle", "-l", "info"]
    workers = [Proc(f"w{i}", [*celery, "-n", f"w{i}-{queue}@%h"], env, tmp_path) for i in (1, 2)]
    try:
        # both workers up (heartbeats written) before any chunk goes out, so both take chunks
        deadline = time.monotonic() + 60
        while alive_workers().count() < 2:
            assert time.monotonic() < deadline, "workers did not start:\n" + "\n".join(w.tail() for w in workers)
            time.sleep(0.3)
        from celery import Celery

        sender = Celery("metrics-sender", broker=settings.CELERY_BROKER_URL, set_as_current=False)
        with sender.connection_for_write() as conn:
            for chunk_id in job.chunks.values_list("pk", flat=True):
                JobChunk.objects.filter(pk=chunk_id).update(dispatched_at=services.timezone.now())
                sender.send_task("controlplane.jobs.tasks.run_chunk_task", args=[chunk_id], queue=queue,
                                 connection=conn)
        deadline = time.monotonic() + 200
        while job.state in JobState.RUNNABLE:
            assert time.monotonic() < deadline, "job did not finish:\n" + "\n".join(w.tail() for w in workers)
            time.sleep(0.5)
            job.refresh_from_db()
        assert job.state == JobState.COMPLETED, job.error_message

        live = scrape(settings, prom_dir)  # workers still running
        assert value(live, "controlplane_workers") == alive_workers().count() == 2
        assert value(live, "controlplane_worker_slots") == 4
        # a worker host's own exporter (WORKER_METRICS_PORT) serves the same summed counters
        from_worker = fetch(f"http://127.0.0.1:{worker_port}/metrics")
        for outcome in ("ok", "failed"):
            assert value(from_worker, "controlplane_rollouts_total", outcome=outcome) == \
                value(live, "controlplane_rollouts_total", outcome=outcome)
    finally:
        for w in workers:
            w.stop()

    rows = Rollout.objects.filter(job=job)
    ok, failed = rows.filter(status="ok").count(), rows.filter(status="failed").count()
    assert ok + failed == N_TASKS * N_REPEATS and failed > 0  # the injected 500s really failed rows
    by_class = dict(rows.filter(status="failed").values_list("failure_class").annotate(n=Count("id")).order_by())
    assert set(by_class) == {"http_5xx"}

    after = scrape(settings, prom_dir)  # both workers have exited: their counters still count
    for parsed in (live, after):
        assert value(parsed, "controlplane_rollouts_total", outcome="ok") == ok
        assert value(parsed, "controlplane_rollouts_total", outcome="failed") == failed
        for failure_class, n in by_class.items():
            assert value(parsed, "controlplane_rollout_failures_total", failure_class=failure_class) == n
        # one lease taken per chunk attempt, each measured from its dispatch
        attempts = job.chunks.aggregate(n=Sum("attempts"))["n"]
        assert value(parsed, "controlplane_chunk_lease_lag_seconds_count") == attempts >= n_chunks
        assert value(parsed, "controlplane_chunk_runs_total", outcome="done") == n_chunks
        assert value(parsed, "controlplane_write_batch_rows_total", kind="rollouts") == N_TASKS * N_REPEATS
        batches = value(parsed, "controlplane_write_batch_seconds_count", kind="rollouts")
        assert batches >= n_chunks and value(parsed, "controlplane_write_batch_seconds_sum", kind="rollouts") > 0
        # state read from the database
        for state in JobState:
            assert value(parsed, "controlplane_jobs", state=state.value) == \
                CollectionJob.objects.filter(state=state).count()
        assert value(parsed, "controlplane_rollouts_stored", outcome="ok") == ok
        assert value(parsed, "controlplane_rollouts_stored", outcome="failed") == failed
        assert value(parsed, "controlplane_chunks", state="done") == n_chunks
        assert value(parsed, "controlplane_chunk_leases_stale") == 0
        assert value(parsed, "controlplane_chunks_waiting") == 0
        assert value(parsed, "controlplane_database_up") == 1
    assert value(after, "controlplane_workers") == 0  # stopped workers say so on shutdown

    # the standalone exporter a second machine runs (python -m controlplane.monitoring.exporter)
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "controlplane.monitoring.exporter", "--dir", str(prom_dir),
                                 "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving" in exporter.stdout.readline()
        exported = fetch(f"http://127.0.0.1:{port}/metrics")
    finally:
        exporter.terminate()
        exporter.wait(10)
    assert value(exported, "controlplane_rollouts_total", outcome="ok") == ok
    assert value(exported, "controlplane_rollout_failures_total", failure_class="http_5xx") == by_class["http_5xx"]

    # the sum is over processes: each worker's own file holds exactly the rows that worker stored
    own = per_process_files(prom_dir, tmp_path)
    worker_pids = {w.popen.pid for w in workers}
    assert worker_pids <= set(own), (worker_pids, sorted(own))
    for pid in worker_pids:
        stored = rows.filter(worker__contains=f":{pid}:")
        mine = own[pid]
        assert value(mine, "controlplane_rollouts_total", outcome="ok") == stored.filter(status="ok").count() > 0
        assert (value(mine, "controlplane_rollouts_total", outcome="failed") or 0) == stored.filter(status="failed").count()
