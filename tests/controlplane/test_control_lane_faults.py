"""Workers that stop or die, with real processes on the default topology (work workers, a control worker, beat):
a SIGTERMed worker hands its chunks back and another worker goes on within seconds, the job ending with exactly
one row per pair; a SIGKILLed worker's chunk goes on within the lease timeout plus one watchdog interval while
every Celery slot of the other worker holds a chunk (its resume slot takes it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobChunk, Rollout
from tests.security.slow_servers import database_url, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEASE_S, WATCHDOG_S = 4.0, 1.0


class Proc:
    def __init__(self, name, args, env, log_dir):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen([sys.executable, "-m", "celery", "-A", "controlplane", *args], cwd=REPO, env=env,
                                      stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n=6000) -> str:
        return f"--- {self.name}\n" + self.log_path.read_bytes()[-n:].decode(errors="replace")

    def kill(self, sig=signal.SIGKILL):
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self):
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(5)
        self.log.close()


@pytest.fixture
def topology(settings, tmp_path):
    tag = uuid.uuid4().hex[:8]
    work, control = f"faults-work-{tag}", f"faults-control-{tag}"
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    settings.CELERY_TASK_DEFAULT_QUEUE, settings.CELERY_CONTROL_QUEUE = work, control
    settings.JOBS_LEASE_TIMEOUT_S = LEASE_S
    env = {**os.environ, "DATABASE_URL": database_url(), "CELERY_TASK_DEFAULT_QUEUE": work,
           "CELERY_CONTROL_QUEUE": control, "JOBS_LEASE_TIMEOUT_S": str(LEASE_S),
           "JOBS_WATCHDOG_INTERVAL_S": str(WATCHDOG_S), "JOBS_RESUME_SLOTS": "1", "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings", "ENDPOINT_ALLOWED_HOSTS": "*"}
    procs = []

    def start(name, kind, concurrency=2):
        if kind == "beat":
            args = ["beat", "-l", "info", "-s", str(tmp_path / f"beat-{tag}")]
        else:
            queue = control if kind == "control" else work
            args = ["worker", "-P", "threads", "-c", str(concurrency), "-Q", queue, "-n", f"{name}-{tag}@%h",
                    "--without-gossip", "--without-mingle", "-l", "info"]
        p = Proc(name, args, env, tmp_path)
        procs.append(p)
        if kind != "beat":
            wait_for(lambda: b" ready." in p.log_path.read_bytes(), 60, f"{name} ready", p.tail)
        return p

    yield start
    for p in procs:
        p.stop()


def _held_by(job, proc) -> list[int]:
    """The chunks of `job` running under a lease of this worker process (lease owner host:pid:...)."""
    return [pk for pk, owner in JobChunk.objects.filter(job=job, state="running").values_list("pk", "lease_owner")
            if owner.split(":")[1:2] == [str(proc.popen.pid)]]


def test_a_sigtermed_worker_hands_its_chunks_back_and_another_goes_on(topology, user, math_dataset, sim_endpoint,
                                                                       simulator_factory):
    sim = simulator_factory(ttft_ms=150, itl_ms=15, output_len_min=20, output_len_max=40)
    ep = sim_endpoint(sim.url, owner=user, request_timeout_s=30)
    topology("control", "control")
    a = topology("a", "work", 2)
    job = services.create_job(owner=user, dataset=math_dataset(12), endpoint=ep, num_repeats=4, chunk_size=6,
                              num_samples_in_parallel=4, launch=True)
    assert job.chunks.count() == 2 and job.total_rollouts == 48
    wait_for(lambda: len(_held_by(job, a)) == 2 and Rollout.objects.filter(job=job).count() >= 4, 60,
             "worker a runs both chunks", a.tail)
    # slow answers while b starts (seconds on a loaded machine), so a still holds both chunks when it is stopped
    sim.configure(ttft_ms=10_000)
    b = topology("b", "work", 2)
    assert len(_held_by(job, a)) == 2, "a finished a chunk while b started: the test's premise is gone"
    t_term = time.monotonic()
    a.kill(signal.SIGTERM)
    # b holds both chunks within seconds; a stops at once instead of running its chunks to their end
    wait_for(lambda: len(_held_by(job, b)) == 2, 10, "worker b took both chunks", lambda: a.tail() + b.tail())
    took_s = time.monotonic() - t_term
    a.popen.wait(10)
    assert took_s < 10
    stored_by_a = Rollout.objects.filter(job=job, worker__contains=f":{a.popen.pid}:").count()
    assert stored_by_a >= 4  # what a had was written
    assert "handing the chunk back" in a.tail(20000)
    sim.configure(ttft_ms=150)
    wait_for(lambda: CollectionJob.objects.get(pk=job.pk).state == "completed", 90, "the job completed",
             lambda: b.tail())
    assert Rollout.objects.filter(job=job).count() == 48  # one row per (task, repeat)
    assert Rollout.objects.filter(job=job).values("task_index", "rollout_index").distinct().count() == 48
    print(f"SIGTERM -> worker b holds both chunks: {took_s:.1f} s; rows a stored first: {stored_by_a}")


def test_a_dead_workers_chunk_resumes_within_lease_and_watchdog_while_slots_are_busy(
        topology, user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(ttft_ms=200, itl_ms=20, output_len_min=30, output_len_max=50)
    ep = sim_endpoint(sim.url, owner=user, request_timeout_s=30)
    topology("control", "control")
    topology("beat", "beat")
    a = topology("a", "work", 1)
    job = services.create_job(owner=user, dataset=math_dataset(40), endpoint=ep, num_repeats=4, chunk_size=4,
                              num_samples_in_parallel=2, launch=True)
    wait_for(lambda: len(_held_by(job, a)) == 1, 60, "worker a runs a chunk", a.tail)
    b = topology("b", "work", 2)
    # a's resume slot may briefly hold a second chunk (a heartbeat late past the 4 s lease on a loaded machine
    # gets its chunk reclaimed and resumed): wait for the steady state of one chunk on a, two on b
    on_a: list[int] = []

    def steady() -> bool:
        on_a[:] = _held_by(job, a)
        return len(on_a) == 1 and len(_held_by(job, b)) == 2

    wait_for(steady, 60, "worker b's two slots busy, a on one chunk", lambda: a.tail() + b.tail())
    [lost] = on_a
    t_kill = time.monotonic()
    a.kill()
    wait_for(lambda: lost in _held_by(job, b), LEASE_S + WATCHDOG_S + 10, "the dead worker's chunk resumed",
             lambda: b.tail())
    took_s = time.monotonic() - t_kill
    # b's two Celery slots hold chunks beside it (the queue is full: each takes the next as one ends, so a moment
    # between two of a slot's chunks is waited out): the resume slot took the lost one, not a Celery slot
    wait_for(lambda: len(_held_by(job, b)) == 3, 10, "b's two slots busy beside the resumed chunk", lambda: b.tail())
    assert lost in _held_by(job, b)
    assert took_s <= LEASE_S + WATCHDOG_S + 1.5, took_s  # + the resume slot's poll and the last heartbeat's age
    assert JobChunk.objects.filter(job=job, state="pending").count() > 3  # and the queue is still full
    print(f"SIGKILL -> chunk resumed on b: {took_s:.1f} s (lease {LEASE_S:g} s + watchdog {WATCHDOG_S:g} s)")
    services.cancel_job(CollectionJob.objects.get(pk=job.pk))
