"""The engine's database side: DbSink (batched, exactly-once rollout writes, metric samples, progress
messages), DbControl (pause / cancel / parallelism from the job row) and ChunkTasks (the chunk's
dataset rows as TaskItems, minus the pairs already stored).

All three share ONE single-thread executor (`DbThread`): every query of a chunk run happens on that
thread, on one reused connection, and the engine's event loop never waits on the database except
through `run_in_executor`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.db import DataError, connection, connections, transaction
from django.db.models import F
from django.utils import timezone

from controlplane.jobs.replica_load import LIVE_MESSAGE_TYPE as REPLICAS_MESSAGE_TYPE, endpoint_group
from controlplane.telemetry import record_rollout_batch
from workers.engine.types import TIMING_FIELDS, ControlState, ProgressTick, RolloutResult

from . import figures
from .events import LiveFigures, ProgressMessage, job_group, live_figures, process_channel_layer, progress_payload
from .models import CHUNK_LEASE, CollectionJob, JobChunk, JobMetricSample, JobState, Rollout
from .versions import VersionTagger
from .stream import lock_job_for_insert, stamp_rows

logger = logging.getLogger(__name__)


def call_with_db_retry(fn, *args, retry_s: float | None = None, what: str = "", **kwargs):
    """fn(*args, **kwargs), again while the database is unreachable (restarted, failed over, the network
    cut): on OperationalError / InterfaceError outside a transaction the broken connection is closed, and
    the call is repeated with exponential backoff (0.2 s doubling to 5 s) for up to JOBS_DB_RETRY_S
    (default 120 s), then the error is raised. Only for idempotent work: the rollout batch is (its INSERT
    ... ON CONFLICT DO NOTHING and the counters it bumps commit together or not at all), and so are the
    reads, heartbeats and state updates of a chunk run."""
    from django.db import InterfaceError, OperationalError

    retry_s = settings.JOBS_DB_RETRY_S if retry_s is None else retry_s
    deadline = time.monotonic() + retry_s
    delay = 0.2
    attempt = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if connection.in_atomic_block:  # an outer transaction is lost with the connection: its owner retries
                raise
            attempt += 1
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("database still unreachable after %d attempts over %.0f s (%s); giving up", attempt,
                             retry_s, what or getattr(fn, "__name__", fn))
                raise
            logger.warning("database error (%s: %s) in %s; reconnecting and retrying in %.1f s", type(exc).__name__,
                           str(exc).strip().splitlines()[0] if str(exc).strip() else "", what or getattr(fn, "__name__", fn),
                           min(delay, left))
            try:
                connection.close()  # a broken connection is never reused; the next query opens a new one
            except Exception:  # noqa: BLE001  (closing a dead connection may raise; it is gone either way)
                pass
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)


def ensure_usable_connection() -> None:
    """Close this thread's connection when the server dropped it while it idled (a database restart),
    so the next query reconnects instead of failing."""
    if connection.connection is not None and not connection.in_atomic_block and not connection.is_usable():
        connection.close()


class DbThread:
    """One thread, one database connection, for all of a chunk run's queries. Every call is retried while
    the database is unreachable (call_with_db_retry): a database restart mid-job delays writes, never drops
    or doubles them."""

    def __init__(self, name="jobs-db"):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, fn, *args):
        return self.executor.submit(call_with_db_retry, fn, *args)

    def call(self, fn, *args, **kwargs):
        """Run fn on the DB thread and wait (from a thread that is not the event loop's)."""
        return self.executor.submit(call_with_db_retry, fn, *args, **kwargs).result()

    async def acall(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, call_with_db_retry, fn, *args)

    def close(self):
        try:
            self.executor.submit(connections.close_all).result(timeout=30)
        except Exception:  # pragma: no cover - best effort
            logger.exception("closing the DB thread's connection failed")
        self.executor.shutdown(wait=True)


# --- exactly-once batch insert ------------------------------------------------------------------
_INSERT_FIELDS = ("job", "task_index", "rollout_index", "status", "failure_class", "error", "reward", "data",
                  *TIMING_FIELDS, "input_tokens", "output_tokens", "attempts", "weight_version", "completed_version",
                  "spans_update", "stale", "worker", "created_at", "trace_id", "arrived_at")
_SQL_BATCH = 500


def _strip_nul(value):
    """PostgreSQL text and jsonb reject U+0000; a model can emit it. Replace it, recursively."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_strip_nul(k): _strip_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_nul(v) for v in value]
    return value


def _rollout_values(job_id, worker, r: RolloutResult, now, arrived_at=None):
    return {
        "job": job_id, "task_index": r.task_index, "rollout_index": r.rollout_index,
        "status": Rollout.Status.OK if r.ok else Rollout.Status.FAILED,
        "failure_class": (r.failure_class or "")[:40], "error": r.error or "", "reward": r.reward,
        "data": r.output_row, **{f: getattr(r, f) for f in TIMING_FIELDS},
        "input_tokens": r.input_tokens if (r.input_tokens or 0) >= 0 else None,
        "output_tokens": r.output_tokens if (r.output_tokens or 0) >= 0 else None,
        "attempts": max(0, min(int(r.attempts or 0), 32767)), "weight_version": (r.weight_version or "")[:100],
        "completed_version": (r.completed_version or r.weight_version or "")[:100],
        "spans_update": bool(r.weight_version and r.completed_version and r.completed_version != r.weight_version),
        "stale": False,
        "worker": worker[:200], "created_at": now, "trace_id": (getattr(r, "trace_id", "") or "")[:32],
        "arrived_at": arrived_at,
    }


def _insert_columns():
    """What both insert paths build their SQL from: Rollout's meta, the inserted fields, quote_name,
    the quoted column list and the quoted ON CONFLICT columns."""
    meta = Rollout._meta
    fields = [meta.get_field(name) for name in _INSERT_FIELDS]
    qn = connection.ops.quote_name
    columns = ", ".join(qn(f.column) for f in fields)
    conflict = ", ".join(qn(meta.get_field(n).column) for n in ("job", "task_index", "rollout_index"))
    return meta, fields, qn, columns, conflict


def _row_params(rows: list[dict], fields) -> list[list]:
    """Each row's values as the database takes them (Field.get_db_prep_save). Given this thread's own
    connection object rather than the `connection` proxy: the proxy resolves the thread's connection on
    every attribute read, about half of the preparation's CPU at 19 fields per row."""
    conn = connections[connection.alias]
    preps = [(f.name, f.get_db_prep_save) for f in fields]
    return [[prep(row[name], conn) for name, prep in preps] for row in rows]


def insert_rollouts(rows: list[dict]) -> list[tuple[str, str, int, int]]:
    """INSERT ... ON CONFLICT (job, task_index, rollout_index) DO NOTHING RETURNING status, failure_class,
    task_index, rollout_index: those of the rows actually inserted (PostgreSQL, and SQLite >= 3.35)."""
    if not rows:
        return []
    if connection.vendor == "postgresql":
        return _copy_insert_rollouts(rows)
    meta, fields, qn, columns, conflict = _insert_columns()
    placeholder = "(" + ", ".join(["%s"] * len(fields)) + ")"
    inserted: list[tuple[str, str]] = []
    for start in range(0, len(rows), _SQL_BATCH):
        part = rows[start:start + _SQL_BATCH]
        params = [value for row_params in _row_params(part, fields) for value in row_params]
        sql = (f"INSERT INTO {qn(meta.db_table)} ({columns}) VALUES {', '.join([placeholder] * len(part))} "
               f"ON CONFLICT ({conflict}) DO NOTHING RETURNING {_returning(qn, meta)}")
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            inserted.extend(tuple(r) for r in cursor.fetchall())
    return inserted


def _returning(qn, meta) -> str:
    return ", ".join(qn(meta.get_field(n).column) for n in ("status", "failure_class", "task_index", "rollout_index"))


_STAGING = "jobs_rollout_staging"


def _copy_insert_rollouts(rows: list[dict]) -> list[tuple[str, str, int, int]]:
    """PostgreSQL: COPY the batch into a session-local staging table, then move it with one
    INSERT ... SELECT ... ON CONFLICT DO NOTHING RETURNING status. Same rows, same exactly-once rule as
    the multi-row VALUES insert, at about half the client and server CPU: no 10,000-placeholder
    statement for psycopg to split and PostgreSQL to parse on every batch."""
    if not connection.in_atomic_block:  # the staging rows must live until the INSERT reads them
        with transaction.atomic():
            return _copy_insert_rollouts(rows)
    meta, fields, qn, columns, conflict = _insert_columns()
    with connection.cursor() as cursor, connection.wrap_database_errors:
        cursor.execute(f"SET LOCAL client_min_messages TO warning; "
                       f"CREATE TEMP TABLE IF NOT EXISTS {_STAGING} ON COMMIT DELETE ROWS AS "
                       f"SELECT {columns} FROM {qn(meta.db_table)} WITH NO DATA")
        with cursor.cursor.copy(f"COPY {_STAGING} ({columns}) FROM STDIN") as copy:
            for row_params in _row_params(rows, fields):
                copy.write_row(row_params)
        # the DELETE ... RETURNING empties the staging table for the next batch in the same transaction
        cursor.execute(f"WITH staged AS (DELETE FROM {_STAGING} RETURNING {columns}) "
                       f"INSERT INTO {qn(meta.db_table)} ({columns}) SELECT {columns} FROM staged "
                       f"ON CONFLICT ({conflict}) DO NOTHING RETURNING {_returning(qn, meta)}")
        return [tuple(r) for r in cursor.fetchall()]


# --- the sink ------------------------------------------------------------------------------------
class DbSink:
    """Buffers RolloutResults and writes them in batches (flush_rows rows or every flush_interval_s),
    exactly once; keeps the job's counters, the chunk's heartbeat, the metric series and the live
    progress messages up to date. Publishing failures are logged, never raised."""

    def __init__(self, *, job, chunk, lease_owner, worker_name, db: DbThread, on_progress=None, channel_layer=None,
                 flush_rows=None, flush_interval_s=None, max_publish_per_s=None, on_stored=None):
        self.job_id = job.pk
        self.chunk_id = chunk.pk
        self.total = job.total_rollouts
        self.lease_owner = lease_owner
        self.worker_name = worker_name
        # One metric series per chunk run: a worker may run several chunks of a job at once, and each
        # series carries its own cumulative counters and its share of the job's parallelism.
        self.series_name = f"{worker_name} chunk {chunk.index}"[:200]
        self.db = db
        self.on_progress = on_progress
        # on_stored(rows): on the DB thread, right after a batch commits, with the rows it really inserted (dicts
        # of _rollout_values) - the CLI appends them to its output files (controlplane.jobs.outfiles)
        self.on_stored = on_stored
        self.flush_rows = flush_rows or settings.JOBS_FLUSH_ROWS
        self.flush_interval_s = flush_interval_s or settings.JOBS_FLUSH_INTERVAL_S
        self.min_publish_interval = 1.0 / (max_publish_per_s or settings.JOBS_PROGRESS_MAX_PER_S)
        # None: the process's channel layer, looked up at the first publish, off the event loop (channels_redis,
        # redis and their imports cost 0.15-0.3 s of CPU: not before the run's first request); False: none
        self.layer = channel_layer
        self._layer_resolved = channel_layer is not None
        self.group = job_group(job.pk)
        self.endpoint_id = job.endpoint_id
        self._replicas_stored = False  # a sample with a replica table was stored since the endpoint's last nudge

        self.buffer: list[RolloutResult] = []
        self.received = 0  # results handed to us
        self.inserted_ok = 0  # rows this run actually inserted (not duplicates)
        self.inserted_failed = 0
        self.duplicates = 0
        self.lease_lost = False
        # the job's state as last read from the database
        self.job_row = {"completed_count": job.completed_count, "failed_count": job.failed_count,
                        "state": job.state, "stalled": job.stalled, "total_rollouts": job.total_rollouts,
                        "parallelism": job.effective_parallelism}
        self.last_tick: ProgressTick | None = None
        self.live: LiveFigures | None = None  # the job's live figures, all chunks summed (events.live_figures)
        self.sampled = False  # a sample of this run is stored (the job's figures include its own)
        self.running_s: float | None = None  # the job's running time (figures.running_seconds), read with them
        self.live_at: tuple[float, int] | None = None  # (unix time, rows stored) they were read at: the message's t
        self._job_stub = job  # for progress_payload's static fields
        self.versions = VersionTagger(job.endpoint_id, job.pk)  # weight versions for servers that report none

        self._flush_lock: asyncio.Lock | None = None
        self._timer: asyncio.Task | None = None
        self._writes: set[asyncio.Task] = set()
        self._last_flush = time.monotonic()
        self._publishing: asyncio.Task | None = None
        self._publish_dirty = False
        self._publish_handle: asyncio.TimerHandle | None = None
        self._last_publish = 0.0
        self._last_publish_warning = 0.0
        self._closed = False
        self._failed_flush: BaseException | None = None

    # -- engine-facing -------------------------------------------------------------------------
    async def rollout(self, result: RolloutResult) -> None:
        self._ensure_started()
        self.versions.stamp(result)
        self.buffer.append(result)
        self.received += 1
        if len(self.buffer) >= self.flush_rows:
            # Backpressure: the emitting worker waits for the batch to be written. With one writer
            # and at most `parallelism` emitters, memory stays bounded.
            await self._flush()

    async def progress(self, tick: ProgressTick) -> None:
        self._ensure_started()
        self.last_tick = tick
        try:
            await self.db.acall(self._write_sample, tick, time.monotonic())
            self._replicas_stored = self._replicas_stored or bool((tick.extra or {}).get("replicas"))
        except Exception:
            logger.exception("job %s: writing a metric sample failed", self.job_id)
        self._request_publish()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()  # safe: a write it started is shielded and awaited below
            await asyncio.gather(self._timer, return_exceptions=True)
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        await self._flush()
        if self._publish_handle is not None:
            self._publish_handle.cancel()
        if self._publishing is not None:
            await asyncio.gather(self._publishing, return_exceptions=True)
        await self._publish(final=True)

    # -- flushing -------------------------------------------------------------------------------
    def _ensure_started(self):
        if self._flush_lock is None:
            self._flush_lock = asyncio.Lock()
            self._timer = asyncio.get_running_loop().create_task(self._flush_timer())
            # the job's state as the run starts (running): the first message goes out now, not at the chunk's
            # start (runtime._mark_running leaves it to the sink, so that the run's first requests go out first)
            self._request_publish()

    async def _flush_timer(self):
        while True:
            await asyncio.sleep(self.flush_interval_s / 2)
            if self.buffer and time.monotonic() - self._last_flush >= self.flush_interval_s:
                try:
                    await self._flush()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("job %s: writing rollouts failed", self.job_id)
                    return  # the error is re-raised to the engine by the next rollout() / close()

    async def _flush(self):
        """Write the buffer. The write runs in its own task, shielded: cancelling the caller (the
        engine stopping a worker, close() stopping the timer) never drops a batch taken from the
        buffer, and its bookkeeping always completes."""
        if self._failed_flush is not None:
            exc, self._failed_flush = self._failed_flush, None
            raise exc
        if self._flush_lock is None:
            self._ensure_started()
        write = asyncio.get_running_loop().create_task(self._write_buffer())
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        await asyncio.shield(write)

    async def _write_buffer(self):
        async with self._flush_lock:
            self._last_flush = time.monotonic()
            if not self.buffer:
                return
            batch, self.buffer = self.buffer, []
            try:
                ok, failed, job_row, lease_ok = await self.db.acall(self._write_batch, batch)
            except BaseException as exc:
                self._failed_flush = exc  # also raised here to the caller that awaited this write
                raise
        self.inserted_ok += ok
        self.inserted_failed += failed
        self.duplicates += len(batch) - ok - failed
        self.job_row.update(job_row)
        if not lease_ok and not self.lease_lost:
            self.lease_lost = True
            logger.warning("job %s chunk %s: lease lost (another worker took the chunk)", self.job_id, self.chunk_id)
        self._request_publish()

    def _write_batch(self, batch: list[RolloutResult]):
        """On the DB thread: insert, bump the job's counters by what was really inserted, heartbeat."""
        now = timezone.now()
        started = time.perf_counter()
        self.versions.tag(batch)
        arrived_at = self.versions.arrived_at
        rows = [_rollout_values(self.job_id, self.worker_name, r, now, arrived_at(r)) for r in batch]
        try:
            with transaction.atomic():
                lock_job_for_insert(self.job_id)  # the job's ids in commit order, for the rollout stream's cursor
                now = stamp_rows(rows)
                inserted = insert_rollouts(rows)
                ok, failed = self._bump(inserted, now)
        except DataError:
            # e.g. a NUL character in a response: clean the batch and write it again
            for row in rows:
                row["data"], row["error"] = _strip_nul(row["data"]), _strip_nul(row["error"])
            with transaction.atomic():
                lock_job_for_insert(self.job_id)
                now = stamp_rows(rows)
                inserted = insert_rollouts(rows)
                ok, failed = self._bump(inserted, now)
        self.versions.written(batch)
        if self.on_stored is not None and inserted:
            new = {(t, k) for _, _, t, k in inserted}
            try:
                self.on_stored([row for row in rows if (row["task_index"], row["rollout_index"]) in new])
            except Exception:  # the output files are reconciled from the table at the end of the run
                logger.exception("job %s: on_stored callback failed", self.job_id)
        failed_by_class: dict[str, int] = {}  # counted once committed: a retried batch is never counted twice
        for status, failure_class, *_ in inserted:
            if status != Rollout.Status.OK:
                failed_by_class[failure_class] = failed_by_class.get(failure_class, 0) + 1
        record_rollout_batch(time.perf_counter() - started, len(rows), ok, failed_by_class)
        lease_ok = self._heartbeat(now)
        job_row = self._read_job()
        return ok, failed, job_row, lease_ok

    def _bump(self, inserted, now):
        ok = sum(1 for status, *_ in inserted if status == Rollout.Status.OK)
        failed = len(inserted) - ok
        if inserted:
            CollectionJob.objects.filter(pk=self.job_id).update(
                completed_count=F("completed_count") + ok, failed_count=F("failed_count") + failed,
                last_progress_at=now, stalled=False, stall_reason="",
            )
        return ok, failed

    def _heartbeat(self, now=None) -> bool:
        return CHUNK_LEASE.beat(self.chunk_id, self.lease_owner, now)

    def _read_job(self):
        row = CollectionJob.objects.filter(pk=self.job_id).values(
            "completed_count", "failed_count", "state", "stalled", "total_rollouts", "num_samples_in_parallel",
            "parallelism_override").first() or {}
        if row:
            row["parallelism"] = row.pop("parallelism_override") or row.pop("num_samples_in_parallel")
            row.pop("num_samples_in_parallel", None)
        return row

    def _write_sample(self, tick: ProgressTick, ticked: float):
        now = timezone.now()
        extra = tick.extra or {}
        if "busy_s" in extra:  # the run was at work while the write waited its turn: t is now, not the tick's time
            extra = {**extra, "busy_s": extra["busy_s"] + max(0.0, time.monotonic() - ticked)}
        JobMetricSample.objects.create(
            job_id=self.job_id, worker=self.series_name, t=now, elapsed_s=tick.elapsed_s,
            completed=max(0, tick.completed), failed=max(0, tick.failed), samples_per_s=tick.samples_per_s,
            output_tokens_per_s=tick.output_tokens_per_s, in_flight=max(0, tick.in_flight),
            parallelism=max(0, tick.parallelism), errors=tick.errors or {}, extra=extra,
        )
        self.sampled = True
        if not self._heartbeat(now) and not self.lease_lost:
            self.lease_lost = True
            logger.warning("job %s chunk %s: lease lost (another worker took the chunk)", self.job_id, self.chunk_id)
        self._read_live(now)

    def _read_live(self, now=None):
        """On the DB thread: the job's figures, every chunk together, as of `now` (what the next message says)."""
        now = now or timezone.now()
        self.job_row.update(self._read_job())
        self.live = live_figures(self.job_id, now)  # every chunk of the job, not only this one
        self._job_stub.state = self.job_row.get("state", self._job_stub.state)
        self.running_s = figures.running_seconds(self._job_stub, now)
        self.live_at = (now.timestamp(), self.job_row.get("completed_count", 0) + self.job_row.get("failed_count", 0))

    # -- progress messages ----------------------------------------------------------------------
    def payload(self) -> ProgressMessage:
        tick = self.last_tick
        job = self._job_stub
        row = self.job_row
        job.total_rollouts = row.get("total_rollouts", job.total_rollouts)
        live = self.live
        if not self.sampled and tick is not None:  # this run's own figures are in no stored sample yet
            live = (live or LiveFigures()).with_run(tick)
        state = row.get("state", job.state)
        # running: the rates and running time are of the moment they were read (up to a tick ago), not of now
        t, stored = self.live_at if self.live is not None and self.live_at and str(state) == "running" else (None, None)
        return progress_payload(
            job, completed=row.get("completed_count", 0), failed=row.get("failed_count", 0),
            state=state, stalled=row.get("stalled", False), live=live,
            parallelism=row.get("parallelism"), running_s=self.running_s, t=t, stored_at_t=stored)

    def _request_publish(self):
        """Coalesce: at most one message per min_publish_interval; the latest state always goes out."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_publish + self.min_publish_interval - time.monotonic()
        if self._publishing is not None and not self._publishing.done():
            self._publish_dirty = True
            return
        if wait > 0:
            if self._publish_handle is None:
                self._publish_handle = loop.call_later(wait, self._publish_later)
            return
        self._publishing = loop.create_task(self._publish())

    def _publish_later(self):
        self._publish_handle = None
        self._request_publish()

    async def _publish(self, final=False):
        self._last_publish = time.monotonic()
        self._publish_dirty = False
        if self.live is None:  # a first message: the job's rate as its other chunks made it, not 0 (a chart dip)
            try:
                await self.db.acall(self._read_live)
            except Exception:
                logger.exception("job %s: reading the job's live figures failed", self.job_id)
        message = self.payload()
        if self.on_progress is not None:
            try:
                self.on_progress(message)
            except Exception:
                logger.exception("on_progress callback failed")
        if not self._layer_resolved:
            self._layer_resolved = True
            self.layer = await asyncio.to_thread(process_channel_layer)
        if self.layer:
            try:
                await asyncio.wait_for(self.layer.group_send(self.group, message), timeout=2.0)
                if self._replicas_stored and self.endpoint_id:
                    # the endpoint page reads the stored tables again (every run summed) when nudged
                    self._replicas_stored = False
                    await asyncio.wait_for(self.layer.group_send(
                        endpoint_group(self.endpoint_id),
                        {"type": REPLICAS_MESSAGE_TYPE, "endpoint_id": self.endpoint_id}), timeout=2.0)
            except Exception as exc:  # Redis down or slow: the run goes on
                now = time.monotonic()
                if now - self._last_publish_warning > 30:
                    self._last_publish_warning = now
                    logger.warning("job %s: progress publish failed (%s: %s); continuing", self.job_id,
                                   type(exc).__name__, exc)
        if self._publish_dirty and not final and not self._closed:
            self._publish_dirty = False
            loop = asyncio.get_running_loop()
            if self._publish_handle is None:
                self._publish_handle = loop.call_later(self.min_publish_interval, self._publish_later)


# --- control -------------------------------------------------------------------------------------
def chunk_parallelism_share(job_id, chunk_id, total, *, starting=False, peers=None) -> int:
    """The job's parallelism is its TOTAL in-flight budget, whatever the number of chunks running
    at once (on one worker or many): each running chunk gets an even share, the remainder going to
    the lowest chunk indexes, at least 1 each. Recomputed on every control poll, so shares grow
    back as chunks finish. A STARTING chunk also counts the job's chunks not yet running: chunks
    started together cannot see each other yet, and each taking the whole budget overshot it until
    their next polls; its first polls grow the share (DbControl.SHARE_GROW_AFTER_S). `peers`, when
    known, is how many runs could start the job's chunks together (the worker slots on its queue, the
    command's engine processes; 1 for a command alone): no more chunks than that start at once, so a
    job of many chunks run by few workers does not start each chunk at a sliver of its parallelism."""
    running = list(JobChunk.objects.filter(job_id=job_id, state=JobChunk.State.RUNNING)
                   .order_by("index").values_list("pk", flat=True))
    if chunk_id not in running:
        running.append(chunk_id)
    n, pos = len(running), running.index(chunk_id)
    if starting:
        waiting = JobChunk.objects.filter(job_id=job_id).exclude(state=JobChunk.State.DONE).count()
        n = max(n, waiting if not peers else min(waiting, peers))
    return max(1, total // n + (1 if pos < total % n else 0))


class DbControl:
    """Polled by the engine (in its control thread): reads the job row on the DB thread."""

    # A chunk keeps its starting share this long before growing to its fair one, so that the chunks already
    # running (polling every CONTROL_POLL_S) have shrunk theirs first: the job's budget is not overshot.
    SHARE_GROW_AFTER_S = 1.0

    def __init__(self, *, job, db: DbThread, sink: DbSink | None = None, chunk=None, initial_parallelism=None):
        self.started = time.monotonic()
        self.job_id = job.pk
        self.chunk_id = getattr(chunk, "pk", None)
        self.db = db
        self.sink = sink
        self.parallelism = initial_parallelism or job.effective_parallelism
        self.last = ControlState()

    def _read(self):
        row = CollectionJob.objects.filter(pk=self.job_id).values_list(
            "state", "parallelism_override", "num_samples_in_parallel").first()
        if row is None or self.chunk_id is None:
            return row
        state, override, requested = row
        share = chunk_parallelism_share(self.job_id, self.chunk_id, override or requested)
        if time.monotonic() - self.started < self.SHARE_GROW_AFTER_S:
            share = min(share, self.parallelism)
        return state, share, None

    def poll(self) -> ControlState:
        if self.sink is not None and self.sink.lease_lost:
            return ControlState(action="cancel")
        try:
            row = self.db.call(self._read)
        except Exception:
            logger.exception("job %s: polling the job state failed; keeping the last state", self.job_id)
            return self.last
        if row is None:  # the job was deleted
            return ControlState(action="cancel")
        state, override, requested = row
        if state == JobState.PAUSED:
            action = "pause"
        elif state in (JobState.QUEUED, JobState.RUNNING):
            action = "run"
        else:  # cancelled, failed (another chunk hit a fatal error), completed
            action = "cancel"
        parallelism = override or requested
        change = None
        if parallelism and parallelism != self.parallelism:
            self.parallelism = change = parallelism
        self.last = ControlState(action=action)
        return ControlState(action=action, parallelism=change)
