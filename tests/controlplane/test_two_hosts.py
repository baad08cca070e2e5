"""Two hosts, one job: Celery workers in two network namespaces of their own (`ip netns` + veth pairs on a
bridge, made here), reaching Redis, PostgreSQL and the model server over the veth link only, share one job;
one host's worker is SIGKILLed mid-job and the job still ends with exactly one row per (task, repeat).

Redis and PostgreSQL listen on 127.0.0.1 of the root namespace, which a namespace cannot reach (its own
loopback is its own): a small TCP forwarder in this process listens on the bridge address and relays to
them, as a firewall-opened port would on a real second machine. Each namespace has only `lo` and its veth
end, so whatever the worker reaches, it reaches over the link.

The job's endpoint names its worker queue (Endpoint.worker_queue), so create_job(launch=True) routes the
chunks to the queue both hosts' workers consume.

Skipped, with the reason, where the kernel or the user may not create namespaces (not root, no netns,
no veth or bridge support, e.g. an unprivileged container).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import Count

from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobChunk, JobState, Rollout
from controlplane.jobs.workers import job_workers

from .test_jobs_e2e import Proc
from tests.lanes import serve_control

N_TASKS, N_REPEATS = 1200, 2
LEASE_S = 5
SUBNET = "10.231.{}.{}"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


class Namespaces:
    """A bridge in the root namespace (10.231.N.1/24) and one namespace per host (10.231.N.2, .3 ...),
    each joined to the bridge by a veth pair. Removed (with everything in them) by close()."""

    def __init__(self, hosts: int):
        tag = uuid.uuid4().hex[:6]
        self.net = 100 + os.getpid() % 100
        self.bridge = f"brsc{tag}"
        self.names = [f"scale-{tag}-h{i}" for i in range(hosts)]
        self.veths = [f"vsc{tag}{i}" for i in range(hosts)]
        self.gateway = SUBNET.format(self.net, 1)
        self.created: list[tuple[str, str]] = []

    def up(self):
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self.names, self.veths)):
            _ip("netns", "add", ns)
            self.created.append(("netns", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            self.created.append(("link", veth))
            _ip("link", "set", veth + "p", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{SUBNET.format(self.net, i + 2)}/24", "dev", veth + "p")
            _ip("netns", "exec", ns, "ip", "link", "set", veth + "p", "up")
        return self

    def close(self):
        for kind, name in reversed(self.created):
            _ip(kind, "del", name, check=False) if kind == "netns" else _ip("link", "del", name, check=False)


def _namespaces_or_skip(hosts) -> Namespaces:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns add)")
    ns = Namespaces(hosts)
    try:
        return ns.up()
    except FileNotFoundError:
        ns.close()
        pytest.skip("the `ip` command (iproute2) is not installed")
    except subprocess.CalledProcessError as exc:
        ns.close()
        pytest.skip(f"the kernel refused to create namespaces, veth or a bridge: {' '.join(exc.cmd)}: "
                    f"{(exc.stderr or '').strip()}")


class Forwarder:
    """TCP relays in a thread of this process: listen on (host, any port) -> 127.0.0.1:target."""

    def __init__(self, host: str):
        self.host = host
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers = []

    async def _pipe(self, reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, target_port):
        async def handle(reader, writer):
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", target_port), 10)
            except (OSError, asyncio.TimeoutError):
                writer.close()
                return
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

        server = await asyncio.start_server(handle, self.host, 0)
        self.servers.append(server)
        return server.sockets[0].getsockname()[1]

    def forward(self, target_port: int) -> int:
        return asyncio.run_coroutine_threadsafe(self._serve(target_port), self.loop).result(10)

    def close(self):
        async def stop():
            for s in self.servers:
                s.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _via(url: str, host: str, port: int) -> str:
    parts = urlsplit(url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit((parts.scheme, f"{auth}{host}:{port}", parts.path, parts.query, parts.fragment))


def _storing_processes(job) -> set[str]:
    """The processes that stored rows of the job: a row's worker name starts "host:pid"."""
    names = Rollout.objects.filter(job=job).values_list("worker", flat=True).distinct()
    return {":".join(w.split(":")[:2]) for w in names}


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_two_hosts_share_a_job_and_lose_nothing_when_one_is_killed(user, math_dataset, sim_endpoint,
                                                                     simulator_factory, tmp_path):
    hosts = _namespaces_or_skip(2)
    fwd = None
    procs: list[Proc] = []
    try:
        fwd = Forwarder(hosts.gateway)
        db = connection.settings_dict
        redis = urlsplit(settings.CELERY_BROKER_URL)
        sim = simulator_factory(seed=5, ttft_ms=40, itl_ms=2, output_len_min=8, output_len_max=16)
        db_port = fwd.forward(int(db.get("PORT") or 5432))
        redis_port = fwd.forward(redis.port or 6379)
        sim_port = fwd.forward(urlsplit(sim.url).port)
        queue = f"gpu-host-{uuid.uuid4().hex[:8]}"
        # the endpoint as the workers see it: the model server at the bridge address, chunks routed to `queue`
        endpoint = sim_endpoint(f"http://{hosts.gateway}:{sim_port}", worker_queue=queue)
        env = {**os.environ, "DATABASE_URL": f"postgres://{db['USER']}@{hosts.gateway}:{db_port}/{db['NAME']}",
               "REDIS_URL": _via(settings.CELERY_BROKER_URL, hosts.gateway, redis_port),
               "CELERY_BROKER_URL": _via(settings.CELERY_BROKER_URL, hosts.gateway, redis_port),
               "CELERY_TASK_DEFAULT_QUEUE": f"control-{queue}", "JOBS_LEASE_TIMEOUT_S": str(LEASE_S),
               "JOBS_WATCHDOG_INTERVAL_S": "1", "PYTHONUNBUFFERED": "1", "ENDPOINT_ALLOWED_HOSTS": "*",
               "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
        if db.get("PASSWORD"):
            env["PGPASSWORD"] = db["PASSWORD"]

        def worker(i):
            return Proc(f"host{i}", ["ip", "netns", "exec", hosts.names[i], sys.executable, "-m", "celery", "-A",
                                     "controlplane", "worker", "-P", "threads", "-c", "2", "-Q", serve_control(f"{queue},control-{queue}"), "-n",
                                     f"host{i}-{queue}@%h", "--without-gossip", "--without-mingle", "-l", "info"],
                        env, tmp_path)

        procs += [worker(0), worker(1)]
        job = services.create_job(owner=user, dataset=math_dataset(N_TASKS), endpoint=endpoint, num_repeats=N_REPEATS,
                                  chunk_size=100, num_samples_in_parallel=32, launch=True)  # routed to `queue`
        assert job.chunks.count() == 12 and job.total_rollouts == N_TASKS * N_REPEATS

        # both hosts take chunks of the one job and store rows of it (holding a chunk is not enough: under
        # load a host can hold its chunks for seconds before its first batch is written)
        deadline = time.monotonic() + 120
        while True:
            holders = {w["worker"] for w in job_workers(job) if w["alive"]}
            if len(holders) == 2 and len(_storing_processes(job)) == 2:
                break
            for p in procs:
                assert p.popen.poll() is None, "a worker exited:\n" + p.tail()
            assert time.monotonic() < deadline, f"both hosts never ran the job (alive: {holders}):\n" + \
                "\n".join(p.tail() for p in procs)
            time.sleep(0.2)
        assert len({w["pid"] for w in job_workers(job) if w["alive"]}) == 2

        # host 0's worker dies hard (its whole process group)
        procs[0].killpg(signal.SIGKILL)
        procs[0].popen.wait(10)
        at_kill = Rollout.objects.filter(job=job).count()
        held_by_dead = JobChunk.objects.filter(job=job, state="running").count()
        assert at_kill < job.total_rollouts, "the kill landed after the job finished: slow the simulator down"
        # beat, in host 1's namespace: the watchdog (run by a worker of the control queue) reclaims the dead
        # host's leases and sends its chunks again, to the job's queue
        procs.append(Proc("beat", ["ip", "netns", "exec", hosts.names[1], sys.executable, "-m", "celery", "-A",
                                   "controlplane", "beat", "-l", "info", "-s", str(tmp_path / "beat-schedule")],
                          env, tmp_path))
        deadline = time.monotonic() + 200
        while True:
            job.refresh_from_db()
            if job.state not in (JobState.QUEUED, JobState.RUNNING):
                break
            assert time.monotonic() < deadline, "job did not finish:\n" + "\n".join(p.tail() for p in procs[1:])
            time.sleep(0.5)
    finally:
        for p in reversed(procs):
            p.stop()
        if fwd is not None:
            fwd.close()
        hosts.close()

    assert job.state == JobState.COMPLETED, job.error_message
    rows = Rollout.objects.filter(job=job)
    pairs = set(rows.values_list("task_index", "rollout_index"))
    dupes = rows.values("task_index", "rollout_index").annotate(n=Count("id")).filter(n__gt=1).count()
    print(f"\nkilled host 0 with {at_kill} rows stored and {held_by_dead} chunks running; final {rows.count()} rows, "
          f"{dupes} duplicated; workers {[(w['worker'], w['chunks_done'], w['rollouts']) for w in job_workers(job)]}")
    assert rows.count() == N_TASKS * N_REPEATS and dupes == 0
    assert pairs == {(t, r) for t in range(N_TASKS) for r in range(N_REPEATS)}
    assert job.completed_count + job.failed_count == N_TASKS * N_REPEATS
    # rows from both hosts: the worker names carry each namespace's process
    by_process = _storing_processes(job)
    assert len(by_process) == 2, by_process
    assert CollectionJob.objects.get(pk=job.pk).chunks.filter(attempts__gte=2).exists()  # a chunk was run again
