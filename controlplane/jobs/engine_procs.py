"""`+engine_processes=N` of the drop-in (collect_rollouts): one job's chunks run in N engine processes on this
host, the command's own and N-1 children, when one process's CPU is the limit (a fast model server: the engine,
the verifier's feeding and the database writes of one Python process top out first).

- The children are started with multiprocessing's spawn context (no fork of a process holding database
  connections, threads and an event loop). Each sets Django up on the command's database settings (the same
  database, a test's too) and runs runtime.run_job_inline, the loop the command runs: the chunks are shared by
  lease (one conditional UPDATE takes a chunk), so a chunk runs in one process at a time and the rollouts' unique
  (job, task, repeat) keeps exactly one row per pair whatever happens. A child takes only chunks nobody holds and
  ends when none is left to take.
- Each running chunk gets an even share of the job's parallelism (sink.chunk_parallelism_share, recomputed on
  every control poll), so the processes' shares sum to the job's num_samples_in_parallel.
- The output files keep one writer, the command: a child sends each batch's newly stored rows (DbSink.on_stored,
  after the commit) and its progress messages through its pipe; the command appends them (OutputFiles.stored) and
  moves its one progress bar. Rows a child stored and died before sending are appended by OutputFiles.finish,
  which checks the job's part of each file against the table (and by the next run's open()).
- Stopping: Ctrl-C reaches the whole process group; SIGTERM to the command is passed on to the children (stop());
  each process gives its chunk back and the job is paused, as with one process. A child whose command died (its
  pipe closed) stops itself the same way. A child that crashed leaves its chunk leased: the command, which knows
  that child is gone, gives the lease back at once (others_running) and runs the chunk itself.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import threading
from multiprocessing.connection import wait as wait_for_connections

logger = logging.getLogger(__name__)

CHUNKS_PER_PROCESS = 2  # a process that finishes early takes another chunk: the tail is shorter than with one each


def chunk_size_for(n_rows: int, processes: int, default: int) -> int:
    """Dataset rows per chunk for a new job run in `processes` processes whose user left chunk_size unset.
    One process: the whole input, one chunk. Chunks are how processes share a job; each one's end drains the
    requests in flight (the slots empty over one request's latency, then the next chunk starts), ~0.26 s a chunk
    at 64 in flight and 200 ms (bench_cli `--arms s6000,s1000`), while resuming is per rollout within a chunk.
    More processes: CHUNKS_PER_PROCESS chunks per process, never more rows than the default."""
    if processes <= 1:
        return max(1, n_rows)
    return max(1, min(default, math.ceil(n_rows / (processes * CHUNKS_PER_PROCESS))))


def _worker_prefix(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}:engine"


# --- the child ---------------------------------------------------------------------------------------------
def _child_main(db_settings: dict, job_id: int, conn, index: int, quiet: bool, argv: list, peers: int | None = None) -> None:
    """A child engine process (spawned): Django on the command's database, then the inline loop. `argv`: the
    command's, to warm the verifier pool while Django sets up, as manage.py does for the command."""
    from workers.cli_start import prewarm_from_argv, quick_exit

    prewarm_from_argv(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    finished = threading.Event()
    send_lock = threading.Lock()
    code = 0
    try:
        from django.conf import settings

        settings.DATABASES["default"] = dict(db_settings)  # before any connection: the command's database
        import django

        django.setup()
        if quiet:
            for name in ("controlplane.jobs", "workers", "httpx", "celery"):
                logging.getLogger(name).setLevel(logging.WARNING)

        def watch_parent():  # the command closed its end (it died) or asked to stop: stop like SIGTERM
            try:
                conn.recv()
            except (EOFError, OSError):
                pass
            if not finished.is_set():
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch_parent, name="engine-parent-watch", daemon=True).start()

        def send(message):
            try:
                with send_lock:
                    conn.send(message)
            except (OSError, ValueError):  # the command is gone: the watcher stops this process
                pass

        def on_progress(payload):
            send(("progress", {"done": int(payload.get("done") or 0), "failed": int(payload.get("failed") or 0)}))

        def on_stored(rows):
            send(("rows", rows))

        from controlplane.jobs.models import CollectionJob
        from controlplane.jobs.runtime import default_worker_name, run_job_inline

        job = CollectionJob.objects.get(pk=job_id)
        # wait_for_lease_s=0: chunks held by others are theirs; this child ends when it finds none to take
        run_job_inline(job, on_progress=on_progress, on_stored=on_stored, resume=False, wait_for_lease_s=0,
                       worker_name=default_worker_name(f"engine{index}"), peers=peers)
    except KeyboardInterrupt:  # the chunk was given back and the job paused by run_job_inline
        code = 130
    except Exception:  # noqa: BLE001  (said on stderr; the command gives back what this process held)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        finished.set()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:
            pass
        try:
            conn.close()
        except OSError:
            pass
    pool = sys.modules.get("workers.engine.verify_pool")
    if pool is not None:  # idle by now; stopped cleanly so that its semaphores are not reported leaked
        try:
            pool.SHARED_VERIFY_POOL.shutdown(wait=True)
        except Exception:  # noqa: BLE001
            pass
    quick_exit(code)  # no interpreter teardown: everything is committed


# --- the command's side ------------------------------------------------------------------------------------
class EngineProcesses:
    """The command's children (module docstring). on_stored(rows) / on_progress(payload) receive what the children
    send, on one reader thread."""

    def __init__(self, job, children: int, *, on_stored=None, on_progress=None, quiet: bool = True):
        self.job = job
        self.n = children
        self.on_stored = on_stored
        self.on_progress = on_progress
        self.quiet = quiet
        self.procs: list = []
        self.conns: list = []
        self.reaped: set[int] = set()
        self._reader: threading.Thread | None = None

    def start(self) -> "EngineProcesses":
        from django.db import connections

        ctx = multiprocessing.get_context("spawn")
        db = dict(connections["default"].settings_dict)
        for i in range(self.n):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_child_main,
                            args=(db, self.job.pk, child_end, i + 1, self.quiet, list(sys.argv), self.n + 1),
                            name=f"engine{i + 1}", daemon=False)  # not daemonic: it hosts a verifier pool
            p.start()
            child_end.close()
            self.procs.append(p)
            self.conns.append(parent_end)
        self._reader = threading.Thread(target=self._read, name="engine-children", daemon=True)
        self._reader.start()
        return self

    def _read(self):
        open_conns = list(self.conns)
        while open_conns:
            for conn in wait_for_connections(open_conns, timeout=1.0):
                try:
                    kind, data = conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    continue
                try:
                    if kind == "rows" and self.on_stored is not None:
                        self.on_stored(data)
                    elif kind == "progress" and self.on_progress is not None:
                        self.on_progress(data)
                except Exception:  # the files are reconciled from the table at the end
                    logger.exception("engine processes: handling a child's %s failed", kind)

    def worker_prefixes(self) -> list[str]:
        return [_worker_prefix(p.pid) for p in self.procs]

    def others_running(self) -> bool:
        """runtime.run_job_inline's hook: whether a child is alive. The chunks of a child that ended while holding
        them (it crashed) are given back now, for the command to run them."""
        alive = False
        for p in self.procs:
            if p.is_alive():
                alive = True
            elif p.pid not in self.reaped:
                self.reaped.add(p.pid)
                self._release_chunks_of(p)
        return alive

    def _release_chunks_of(self, p) -> None:
        from .models import JobChunk
        from .runtime import release_lease

        held = JobChunk.objects.filter(job_id=self.job.pk, state=JobChunk.State.RUNNING,
                                       lease_owner__startswith=_worker_prefix(p.pid)).values_list("pk", "lease_owner")
        for chunk_id, owner in list(held):
            if release_lease(chunk_id, owner):
                logger.warning("job %s chunk %s: engine process %s ended (exit %s) holding it; run here instead",
                               self.job.pk, chunk_id, p.pid, p.exitcode)

    def join(self) -> None:
        """Wait for the children to end (they do once no chunk is left to take) and for their last messages."""
        for p in self.procs:
            p.join()
        self._close()

    def signal_children(self) -> None:
        """SIGTERM to the children alive: each gives its chunk back and pauses the job (safe in a signal handler)."""
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the children as Ctrl-C stops the command (their chunks given back), killing any that hang."""
        self.signal_children()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._close()

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.join(10)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in self.procs:
            if p.exitcode not in (0, None) and p.pid not in self.reaped:
                self.reaped.add(p.pid)
                self._release_chunks_of(p)
