"""Private Redis and PostgreSQL servers for fault tests: each on a free port, in a temporary directory, so a
test can restart or stop them without disturbing the shared ones (or other tests).

    redis = PrivateRedis(tmp_path); redis.start(); redis.restart(down_s=2, keep_data=False); redis.stop()
    pg = PrivatePostgres(tmp_path); pg.start(); pg.url("cp"); pg.restart(); pg.stop()

PostgreSQL's binaries are looked up in PATH, then /usr/lib/postgresql/*/bin; `initdb` refuses root, so as root
the server runs as the `postgres` user. Either class raises `Unavailable` (tests skip on it) when it cannot run.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class Unavailable(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, up: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not {'up' if up else 'down'} after {timeout}s")


class PrivateRedis:
    """redis-server on a free port; `restart()` shuts it down with SAVE (what `redis-cli shutdown` and a
    service restart do) and starts it again on the same port and data directory, so queued Celery
    messages survive as they would in production."""

    def __init__(self, base: Path):
        self.binary = shutil.which("redis-server")
        if not self.binary:
            raise Unavailable("redis-server not installed")
        self.dir = Path(base) / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                                      "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        _wait_port(self.port, 15)

    def stop(self, save: bool = True) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import redis

        try:
            try:
                redis.Redis(port=self.port, socket_timeout=15).shutdown(save=save, nosave=not save)
            except redis.exceptions.ConnectionError:
                pass  # the server closes the connection as it exits
            self.proc.wait(15)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()

    def restart(self, down_s: float = 2.0, keep_data: bool = True) -> None:
        """keep_data=False: a crash with nothing saved (the queued messages are gone when it comes back)."""
        self.stop(save=keep_data)
        if not keep_data:
            (self.dir / "dump.rdb").unlink(missing_ok=True)
        time.sleep(down_s)
        self.start()


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        raise Unavailable(f"PostgreSQL's {name} not found (PATH, /usr/lib/postgresql/*/bin)")
    return found


class PrivatePostgres:
    """A PostgreSQL cluster made with initdb in a temporary directory, on a free port (trust auth, user postgres)."""

    def __init__(self, base: Path):
        self.initdb, self.pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        self.port = free_port()
        self.as_user = None
        if os.geteuid() == 0:
            try:
                self.as_user = pwd.getpwnam("postgres")
            except KeyError:
                raise Unavailable("running as root and there is no postgres user for initdb") from None
        # its own temporary directory (pytest's are private to root, out of the postgres user's reach)
        self.dir = Path(tempfile.mkdtemp(prefix="private-pg-", dir=base if not self.as_user else None))
        self.data = self.dir / "data"
        if self.as_user:
            os.chown(self.dir, self.as_user.pw_uid, self.as_user.pw_gid)

    def _run(self, *args, timeout=60):
        def demote():
            if self.as_user:
                os.setgid(self.as_user.pw_gid)
                os.setuid(self.as_user.pw_uid)

        r = subprocess.run(list(args), preexec_fn=demote, capture_output=True, text=True, timeout=timeout,
                           cwd=self.dir)
        if r.returncode:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        if not self.data.exists():
            self._run(self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--no-sync", timeout=120)
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.dir / "pg.log"), "-w", "-t", "60", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off", "start", timeout=90)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(self.pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=60)

    def destroy(self) -> None:
        """Stop the server and delete its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self, down_s: float = 2.0) -> None:
        """Stop (fast: every client connection is cut), stay down `down_s`, start again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def log_tail(self, n: int = 3000) -> str:
        p = self.dir / "pg.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""
