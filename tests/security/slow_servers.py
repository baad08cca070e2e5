"""Hostile model servers on 127.0.0.1 for the capacity and deadline tests: one that accepts connections and never
answers, one that answers one byte at a time for ever (every read succeeds, so no read timeout fires), and the
helpers to run a real Celery worker against this test's database on a queue of its own."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from django.db import connection
from tests.lanes import serve_control

REPO = Path(__file__).resolve().parents[2]


class _Listener:
    def __init__(self, handle):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.stopped = threading.Event()
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._handle = handle
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            self._handle(conn, self.stopped)
        except OSError:
            pass

    def close(self):
        self.stopped.set()
        for c in [self.sock, *self.conns]:
            try:
                c.close()
            except OSError:
                pass


def hanging_server() -> _Listener:
    """Accepts, reads the request, never answers."""
    def handle(conn, stopped):
        conn.settimeout(1.0)
        while not stopped.is_set():
            try:
                if conn.recv(65536) == b"":
                    return
            except socket.timeout:
                continue
    return _Listener(handle)


def trickling_server(interval_s: float = 0.5) -> _Listener:
    """Answers 200 with a body sent one byte every `interval_s`, for ever (chunked: it announces no size a byte cap
    could refuse up front)."""
    def handle(conn, stopped):
        conn.settimeout(5.0)
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not stopped.is_set():
            conn.sendall(b"1\r\n \r\n")
            time.sleep(interval_s)
    return _Listener(handle)


# --- a real Celery worker ---------------------------------------------------------------------------------
def database_url() -> str:
    s = connection.settings_dict
    auth = s["USER"] or ""
    if s.get("PASSWORD"):
        auth += ":" + s["PASSWORD"]
    return f"postgres://{auth}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


class Worker:
    """`celery worker -P threads -c N` on `queue` (also its default queue: chunks sent again go there), with this
    test's database and extra environment."""

    def __init__(self, queue: str, log_dir: Path, concurrency: int = 2, **env):
        self.log_path = log_dir / f"worker-{queue}.log"
        self.log = open(self.log_path, "wb")
        full_env = {**os.environ, "DATABASE_URL": database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue,
                    "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
                    **{k: str(v) for k, v in env.items()}}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", str(concurrency),
             "-Q", serve_control(queue), "-n", f"{queue}@%h", "--without-gossip", "--without-mingle", "-l", "info"],
            cwd=REPO, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self):
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self.log.close()

    def tail(self, n=4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")


def send_chunks(job, queue: str) -> None:
    """Dispatch a job's chunks to `queue` (what create_job(launch=True) does on the default queue)."""
    from celery import Celery
    from django.conf import settings

    from controlplane.jobs.models import JobChunk

    sender = Celery("security-sender", broker=settings.CELERY_BROKER_URL, set_as_current=False)
    ids = list(job.chunks.values_list("pk", flat=True))
    JobChunk.objects.filter(pk__in=ids).update(dispatched_at=job.created_at)
    with sender.connection_for_write() as conn:
        for chunk_id in ids:
            sender.send_task("controlplane.jobs.tasks.run_chunk_task", args=[chunk_id], queue=queue, connection=conn)


def wait_for(predicate, timeout_s: float, what: str, tail=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s\n{tail()}"
        time.sleep(0.2)
