"""Running one chunk of a job: lease, engine, database sink, outcome. The Celery task and the CLI's
inline runner (run_job_inline, here) both call run_chunk, so there is one code path.

Worker command (threads pool: prefork children are daemonic and cannot host the engine's
verification process pool; the engine runs in the task's own thread on its own event loop, uvloop by default):

    celery -A controlplane worker -P threads -c 4 -l info
    celery -A controlplane beat -l info          # schedules tasks.watchdog every ~10 s

Lease protocol (controlplane.leases, models.CHUNK_LEASE): a chunk is taken with one conditional UPDATE
(pending, or running with a heartbeat older than JOBS_LEASE_TIMEOUT_S); the holder heartbeats on every
batch flush, progress tick and control poll. A SIGKILLed worker stops heartbeating; the watchdog resets its
chunk and dispatches it again; the new holder skips every (task, repeat) already stored, and the unique
constraint makes any overlap harmless, so the job ends with exactly one row per pair.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.endpoints.services import endpoint_spec
from controlplane.leases import stale_before
from controlplane.telemetry import record_chunk_run, record_lease_taken
from workers.engine.loop import collector_tuned, run as run_on_loop
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec
import workers.nemo_gym.engine  # noqa: F401  (registers the NeMo Gym rollout sources: agents' /run, remote /verify)
from workers.instrument import Instrumentation, instrument_run
from workers.tracing import TraceConfig

from . import capacity, services
from .extensions import wrap_run
from .events import publish_job_state
from .models import CHUNK_LEASE, CollectionJob, InvalidTransition, JobChunk, JobState
from .chunk_tasks import ChunkTasks
from .sink import (
    DbControl, DbSink, DbThread, call_with_db_retry, chunk_parallelism_share, ensure_usable_connection,
)
from .verifier_checks import bind_options
from .verify_cache import verify_cache_spec

logger = logging.getLogger(__name__)

MAX_INCOMPLETE_ATTEMPTS = 3


def default_worker_name(kind="worker"):
    return f"{socket.gethostname()}:{os.getpid()}:{kind}:{threading.get_ident() % 100000}"


def acquire_lease(chunk_id, lease_owner, dispatched_at=None) -> bool:
    """Take the chunk if it is pending or its holder stopped heartbeating (CHUNK_LEASE.claim: one conditional
    UPDATE, so only one taker wins). dispatched_at (when the message was sent) measures the lease lag
    (controlplane_chunk_lease_lag_seconds)."""
    now = timezone.now()
    taken = CHUNK_LEASE.claim(chunk_id, lease_owner, now=now, started_at=now, finished_at=None)
    if taken:
        record_lease_taken(dispatched_at, now)
    return taken


def release_lease(chunk_id, lease_owner) -> bool:
    """Give the chunk back (pending) so it can be run again (pause, cancel, failure)."""
    return CHUNK_LEASE.release(chunk_id, lease_owner, lease_owner="", heartbeat_at=None)


def build_spec(job, worker_name="") -> CollectionSpec:
    return CollectionSpec(
        endpoint=endpoint_spec(job.endpoint),
        parallelism=job.effective_parallelism,
        responses_create_params=dict(job.responses_create_params or {}),
        verifier=job.verifier,
        # secrets the options refer to (a judge's endpoint key) resolved now, in memory, with the owner's rights
        verifier_options=(bind_options(job.verifier, job.verifier_options, job.owner)
                          if job.verify_mode != "deferred" else dict(job.verifier_options or {})),
        verify_mode=job.verify_mode,
        worker_name=worker_name,
        verify_cache=job.verify_cache, verify_processes=settings.VERIFY_POOL_PROCESSES,
        verify_concurrency=settings.VERIFY_CONCURRENCY, **verify_cache_spec(job),
        add_seed=bool((job.collection_options or {}).get("add_seed")),
        tracing=trace_config(job),
    )


def job_trace_key(job) -> str:
    """The job's key for its span ids (workers.tracing.job_span_ids): the same in every worker."""
    return f"{job.pk}:{job.created_at.isoformat() if job.created_at else ''}"


def trace_config(job, chunk=None) -> TraceConfig | None:
    """The run's OpenTelemetry set-up from the deployment's settings (TRACING_*), None when tracing is off."""
    mode = getattr(settings, "TRACING_MODE", "off")
    if mode not in ("spans", "otlp"):
        return None
    attributes = {"job.id": job.pk, "job.name": job.name, "endpoint.id": job.endpoint_id}
    if chunk is not None:
        attributes.update({"chunk.id": chunk.pk, "chunk.index": chunk.index, "chunk.start_row": chunk.start_row,
                           "chunk.end_row": chunk.end_row})
    config = TraceConfig(mode=mode, endpoint=settings.TRACING_OTLP_ENDPOINT, service_name=settings.TRACING_SERVICE_NAME,
                         job_key=job_trace_key(job), attributes=attributes,
                         sample_ratio=getattr(settings, "TRACING_SAMPLE_RATIO", 1.0))
    return config if config.enabled else None



def instrumentation(job) -> Instrumentation:
    """What a run of this job carries: telemetry in every progress tick (stored by the DbSink in
    JobMetricSample.extra; vLLM's /metrics scraped for vLLM endpoints) and, for `parallelism_auto` jobs, the
    adaptive controller (settings DIAGNOSTICS_TELEMETRY, DIAGNOSTICS_SCRAPE_INTERVAL_S, DIAGNOSTICS_ADAPTIVE_MAX)."""
    return Instrumentation(
        telemetry=getattr(settings, "DIAGNOSTICS_TELEMETRY", True),
        scrape_vllm=getattr(job.endpoint, "kind", "vllm") == "vllm",
        scrape_interval_s=float(getattr(settings, "DIAGNOSTICS_SCRAPE_INTERVAL_S", 5.0)),
        adaptive=bool(job.parallelism_auto),
        adaptive_max=int(getattr(settings, "DIAGNOSTICS_ADAPTIVE_MAX", 1024)),
    )


def _mark_running(job_id):
    """Queued -> running. Returns the job, or None when it is not runnable (paused, cancelled ...). The new state
    is published by the run's sink as the engine starts (DbSink._ensure_started), not here: publishing from here
    read the job's live figures and imported the channel layer before the run's first request."""
    with transaction.atomic():
        job = CollectionJob.objects.select_for_update().select_related("endpoint", "dataset").get(pk=job_id)
        if job.state not in JobState.RUNNABLE:
            return None
        job.mark_running()
    return job


def run_chunk(chunk_id, worker_name="", on_progress=None, redispatch=True, on_stored=None, summaries=None,
              peers=None) -> str:
    """Run one chunk to its end (_run_chunk); its outcome is counted in controlplane_chunk_runs_total.
    on_stored(rows): see DbSink. summaries: see services.finalize_job. peers: how many runs could start the
    job's chunks together (sink.chunk_parallelism_share); None: the worker slots on the job's queue."""
    with collector_tuned():  # the run's garbage is collected as it ends, its sink and loop included
        outcome = _run_chunk(chunk_id, worker_name, on_progress, redispatch, on_stored, summaries, peers)
    record_chunk_run(outcome)
    return outcome


def _run_chunk(chunk_id, worker_name="", on_progress=None, redispatch=True, on_stored=None, summaries=None,
               peers=None) -> str:
    """Run one chunk to its end. Returns the outcome:
    "done"        every pair of the chunk is stored (the job is finalized when it was the last chunk)
    "busy"        another live worker holds the lease (nothing done)
    "skipped"     the chunk is already done, or the job is not runnable (paused, cancelled, finished)
    "paused" / "cancelled"  the job was paused or cancelled mid-run; the chunk is pending again
    "yielded" / "deadline"  handed back (pending, sent again) for another user's fair share, or at the run's total
                  deadline (JOBS_CHUNK_DEADLINE_S) with rows stored; with none stored, the job is "failed"
    "handed_back" the worker was asked to stop (SIGTERM): its rows are written, the chunk pending and sent again
    "failed"      the job was failed with a clear message (fatal engine error or an exception here)
    "lost_lease"  this worker stalled and another took the chunk over; it finishes the chunk
    "incomplete"  the run ended with pairs missing from the table; the chunk is pending again
    """
    worker_name = worker_name or default_worker_name()
    ensure_usable_connection()  # the database may have restarted since this thread last used it
    chunk = call_with_db_retry(lambda: JobChunk.objects.filter(pk=chunk_id).select_related("job").first(),
                               what=f"reading chunk {chunk_id}")
    if chunk is None or chunk.state == JobChunk.State.DONE or chunk.job.state not in JobState.RUNNABLE:
        return "skipped"
    lease = f"{worker_name}#{uuid.uuid4().hex[:8]}"
    if not call_with_db_retry(acquire_lease, chunk_id, lease, chunk.dispatched_at, what=f"leasing chunk {chunk_id}"):
        return "busy"
    job = None
    try:
        job = call_with_db_retry(_mark_running, chunk.job_id, what=f"starting job {chunk.job_id}")
        if job is None:
            release_lease(chunk_id, lease)
            return "skipped"
        chunk.refresh_from_db()
        logger.info("job %s chunk %s (rows %s-%s): started by %s", job.pk, chunk.index, chunk.start_row,
                    chunk.end_row, worker_name)
        db = DbThread(name=f"jobs-db-{chunk_id}")
        try:
            tasks = ChunkTasks(job=job, chunk=chunk, db=db)
            sink = DbSink(job=job, chunk=chunk, lease_owner=lease, worker_name=worker_name, db=db,
                          on_progress=on_progress, on_stored=on_stored)
            spec = build_spec(job, worker_name)
            if peers == 1 and job.verify_cache == "job" and spec.verify_cache_shared_choice == "measured":
                # the caller runs every chunk of the job in this one process: a shared lookup could find only
                # what this run stored itself, so the run keeps its local cache and never opens Redis
                spec.verify_cache_shared_choice = "alone"
            if peers is None:  # 0 (no worker registered, no Redis): unknown, every open chunk may start now
                peers = capacity.queue_slots(capacity.queue_of(job)) or None
            spec.parallelism = chunk_parallelism_share(job.pk, chunk.pk, job.effective_parallelism, starting=True,
                                                       peers=peers)
            spec.tracing = trace_config(job, chunk)
            # the job's control, plus the run's total deadline and the owner's fair share (capacity.py)
            control = capacity.guard(DbControl(job=job, db=db, sink=sink, chunk=chunk,
                                               initial_parallelism=spec.parallelism), job=job, chunk=chunk)
            # the wrappers other apps registered (profiling: switched on / off while it runs)
            summary = run_on_loop(run_collection(spec, tasks, *wrap_run(
                job, *instrument_run(spec, sink, control, instrumentation(job)), db=db, worker_name=worker_name)))
        finally:
            db.close()
        # The database may have restarted while the engine ran: this thread's idle connection is then dead.
        # Everything below is idempotent, so it is retried until the database answers (JOBS_DB_RETRY_S).
        ensure_usable_connection()
        return call_with_db_retry(_finish_chunk_run, chunk, job, lease, summary, sink, tasks, redispatch, control,
                                  summaries, what=f"finishing chunk {chunk_id}")
    except Exception as exc:
        logger.exception("chunk %s failed", chunk_id)
        try:
            release_lease(chunk_id, lease)
            target = job or CollectionJob.objects.get(pk=chunk.job_id)
            services.fail_job(target, f"Worker error in chunk {chunk.index}: {type(exc).__name__}: {exc}")
        except Exception:
            logger.exception("could not record the failure of chunk %s", chunk_id)
        return "failed"
    except BaseException:  # KeyboardInterrupt / SystemExit: give the chunk back at once, then stop
        try:
            release_lease(chunk_id, lease)
        except Exception:
            pass
        raise


def _finish_chunk_run(chunk, job, lease, summary, sink, tasks, redispatch, guard=None, summaries=None) -> str:
    """After the engine returned: record the chunk's outcome (see run_chunk). Idempotent, so that it can be
    retried through a database restart. `guard` (capacity.ChunkGuard) says whether the run was stopped at its
    deadline or to give its owner's share back: the chunk is handed back ("deadline" / "yielded"), or, at a
    deadline with nothing stored, the job fails with the reason."""
    chunk_id = chunk.pk
    logger.info("job %s chunk %s: %s (stored %d ok + %d failed, %d already present, %d skipped, %.1fs)",
                job.pk, chunk.index, "fatal: " + summary.fatal_error if summary.fatal_error else
                "paused" if summary.paused else "cancelled" if summary.cancelled else "finished",
                sink.inserted_ok, sink.inserted_failed, sink.duplicates, tasks.skipped, summary.elapsed_s)

    if sink.lease_lost:
        return "lost_lease"
    if summary.fatal_error:
        release_lease(chunk_id, lease)
        services.fail_job(job, f"Collection stopped: {summary.fatal_error}")
        return "failed"
    if summary.paused or summary.cancelled:
        stopped_for = getattr(guard, "stopped_for", None)
        if stopped_for == "handback":  # the worker is stopping: the rows are written, another worker goes on
            capacity.hand_back_lease(chunk_id, lease)
        else:
            release_lease(chunk_id, lease)
        if stopped_for and (why := guard.deadline_failure(sink.inserted_ok + sink.inserted_failed)):
            services.fail_job(job, f"Collection stopped: {why}")
            return "failed"
        job.refresh_from_db(fields=["state"])
        if redispatch and job.state in JobState.RUNNABLE:  # resumed meanwhile, or handed back: run it again
            services.dispatch_chunks(job, [chunk_id])
        if stopped_for:
            return {"share": "yielded", "handback": "handed_back"}.get(stopped_for, "deadline")
        return "paused" if summary.paused else "cancelled"
    stored, expected = tasks.stored_count(), tasks.expected_count
    if stored < expected:  # never mark a chunk done with pairs missing
        release_lease(chunk_id, lease)
        chunk.refresh_from_db(fields=["attempts"])
        logger.error("job %s chunk %s: %d of %d rollouts stored after a complete run (engine returned %d of "
                     "%d)", job.pk, chunk.index, stored, expected, sink.received, tasks.emitted)
        if chunk.attempts >= MAX_INCOMPLETE_ATTEMPTS:
            services.fail_job(job, f"Internal error: chunk {chunk.index} still misses {expected - stored} of "
                                   f"{expected} rollouts after {chunk.attempts} attempts; resume to retry")
            return "failed"
        if redispatch:
            services.dispatch_chunks(job, [chunk_id])
        return "incomplete"
    now = timezone.now()
    if not CHUNK_LEASE.held(chunk_id, lease).update(state=JobChunk.State.DONE, finished_at=now, heartbeat_at=now):
        return "lost_lease"
    if job.open_ended:  # open-ended: the next chunks, as the buffer has room
        services.top_up_open_ended(job, launch=redispatch)
    if not JobChunk.objects.filter(job_id=job.pk).exclude(state=JobChunk.State.DONE).exists():
        services.finalize_job(job, launch=redispatch, summaries=summaries)
    return "done"


# --- the CLI path: every chunk in this process ------------------------------------------------
def run_job_inline(job, on_progress=None, *, worker_name=None, resume=True, wait_for_lease_s=None, stats=None,
                   on_stored=None, others_running=None, summaries=None, peers=None):
    """Run every unfinished chunk of the job in this process, with the same code path as the Celery
    task (runtime.run_chunk), no worker needed. on_progress(payload) receives each progress message
    (events.progress_payload) — for a progress bar. A paused, failed or cancelled job is resumed first
    when `resume` (rerunning the CLI resumes). Chunks leased by another live process are waited for
    (their lease expires if that process died). Ctrl-C pauses the job, so a rerun resumes it.
    `stats` (a dict), when given, receives `lease_wait_s`: the time spent waiting for such leases.
    `on_stored(rows)` receives each batch's newly stored rows right after it commits (the CLI's output files).
    `others_running()`, when given, says whether this run's own other engine processes are still at work
    (controlplane.jobs.engine_procs): chunks they hold are waited for as long as it is true, not counted as a
    lease wait and never given up on. `summaries`: a StoredRowSummaries that on_stored feeds (finalize_job
    takes the job's summaries from it instead of reading the table back). `peers`: the processes that run the
    job's chunks together (1: this one alone), so each chunk starts with its share of the parallelism and not
    a share counting chunks nobody will start meanwhile (run_chunk). Returns the job, refreshed."""
    worker_name = worker_name or default_worker_name("inline")
    wait_for_lease_s = settings.JOBS_LEASE_TIMEOUT_S * 3 if wait_for_lease_s is None else wait_for_lease_s
    job.refresh_from_db()
    if resume and job.state in (JobState.PAUSED, JobState.FAILED, JobState.CANCELLED):
        services.resume_job(job, launch=False)
    waited_since = None
    stats = {} if stats is None else stats
    stats["lease_wait_s"] = 0.0
    try:
        while True:
            t_pass = time.monotonic()
            ensure_usable_connection()  # the database may have restarted since the last chunk

            def open_chunks():
                job.refresh_from_db()
                return list(JobChunk.objects.filter(job=job).exclude(state=JobChunk.State.DONE)
                            .order_by("index").values_list("pk", flat=True))

            chunk_ids = call_with_db_retry(open_chunks, what=f"reading job {job.pk}")
            if job.state not in JobState.RUNNABLE:
                break
            if not chunk_ids:
                services.finalize_job(job, launch=False, summaries=summaries)
                break
            progressed = False
            for chunk_id in chunk_ids:
                outcome = run_chunk(chunk_id, worker_name, on_progress=on_progress, redispatch=False,
                                    on_stored=on_stored, summaries=summaries, peers=peers)
                if outcome != "busy":
                    progressed = True
                call_with_db_retry(job.refresh_from_db, what=f"reading job {job.pk}")
                if job.state not in JobState.RUNNABLE:
                    break
            if progressed:
                waited_since = None
            elif others_running is not None and others_running():  # this run's other processes hold them
                waited_since = None
                time.sleep(0.25)
            else:  # every open chunk is leased by someone else: wait for them or for their lease to expire
                waited_since = waited_since or time.monotonic()
                if time.monotonic() - waited_since > wait_for_lease_s:
                    if wait_for_lease_s > 0:  # 0: an engine process that takes only free chunks, ending as asked
                        logger.warning("job %s: chunks still leased by other workers; giving up waiting", job.pk)
                    break
                time.sleep(1.0)
                stats["lease_wait_s"] += time.monotonic() - t_pass
    except KeyboardInterrupt:
        job.refresh_from_db()
        if job.state in JobState.RUNNABLE:
            try:
                services.pause_job(job)
            except InvalidTransition:
                pass
        raise
    job.refresh_from_db()
    if job.state == JobState.COMPLETED:  # a fast job's exact pass, in this process too
        from .verification import run_pending

        run_pending(job, worker_name)
        job.refresh_from_db()
    return job


# --- watchdog ---------------------------------------------------------------------------------
def stall_after_s(job) -> float:
    """How long a running job may go without a new rollout before it is flagged stalled: JOBS_STALL_AFTER_S,
    and never less than one request's timeout on its endpoint (a slow model is not a stalled job)."""
    endpoint = job.endpoint
    request_s = float(getattr(endpoint, "request_timeout_s", 0) or 0) + float(getattr(endpoint, "connect_timeout_s", 0) or 0)
    return max(float(settings.JOBS_STALL_AFTER_S), request_s)


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _worker_names(owners) -> str:
    names = sorted({o.split("#", 1)[0] for o in owners if o})
    return ", ".join(names) if names else "(unknown)"


def diagnose_stall(job, now=None) -> str:
    """One sentence on why a running job makes no progress, from its chunks' leases and heartbeats and its
    latest metric samples: what the job page shows under the stalled badge."""
    from .models import JobMetricSample

    now = now or timezone.now()
    idle_since = job.last_progress_at or job.started_at or now
    head = f"no progress for {_duration((now - idle_since).total_seconds())}"
    stale = stale_before(now)
    chunks = list(JobChunk.objects.filter(job=job).values("state", "lease_owner", "heartbeat_at"))
    running = [c for c in chunks if c["state"] == JobChunk.State.RUNNING]
    live = [c for c in running if c["heartbeat_at"] and c["heartbeat_at"] >= stale]
    dead = [c for c in running if c not in live]
    pending = [c for c in chunks if c["state"] == JobChunk.State.PENDING]
    if live:
        workers = _worker_names(c["lease_owner"] for c in live)
        window = now - timedelta(seconds=max(60.0, settings.JOBS_LEASE_TIMEOUT_S * 2))
        samples = list(JobMetricSample.objects.filter(job=job, t__gte=window).order_by("-t")
                       .values("worker", "in_flight", "errors")[:200])
        latest: dict[str, int] = {}
        errors: dict[str, int] = {}
        for sample in samples:
            latest.setdefault(sample["worker"], sample["in_flight"])
            for kind, n in (sample["errors"] or {}).items():
                errors[kind] = errors.get(kind, 0) + int(n or 0)
        in_flight = sum(latest.values())
        error_words = ", ".join(f"{n} {kind}" for kind, n in sorted(errors.items(), key=lambda kv: -kv[1]) if n)
        if error_words:
            return (f"{head}: model server not answering ({error_words} in the last minutes; {in_flight} requests in "
                    f"flight); worker {workers} is alive")
        if in_flight:
            return (f"{head}: model server not answering: {in_flight} requests in flight and none finished; "
                    f"worker {workers} is alive")
        return f"{head}: worker {workers} holds the chunks and heartbeats but sends no requests"
    if dead:
        oldest = min(c["heartbeat_at"] for c in dead if c["heartbeat_at"]) if any(c["heartbeat_at"] for c in dead) else None
        since = f" {_duration((now - oldest).total_seconds())} ago" if oldest else ""
        return (f"{head}: all chunks leased by worker {_worker_names(c['lease_owner'] for c in dead)} whose heartbeat "
                f"stopped{since}; they are handed out again once the lease expires ({settings.JOBS_LEASE_TIMEOUT_S:g} s)")
    if pending:
        lost = [c for c in pending if c["lease_owner"] and c["heartbeat_at"]]
        last = ""
        if lost:
            newest = max(c["heartbeat_at"] for c in lost)
            last = (f"; they were leased by worker {_worker_names(c['lease_owner'] for c in lost)} whose heartbeat "
                    f"stopped {_duration((now - newest).total_seconds())} ago")
        return (f"{head}: {len(pending)} chunk(s) wait for a worker and none has taken them{last}: is a Celery "
                f"worker running on queue {settings.CELERY_TASK_DEFAULT_QUEUE!r}?")
    return f"{head}: no chunk is running or waiting"



def watchdog(now=None, dispatch=True, broker_lost: bool | None = None) -> dict:
    """Run periodically (Celery beat). Returns what it did.
    * chunks RUNNING whose heartbeat is older than the lease timeout (a dead worker) go back to
      pending and are dispatched again;
    * pending chunks of a runnable job with no live chunk, dispatched long ago (a lost message), are
      dispatched again; every pending chunk of a runnable job is, at once, when the broker lost its data
      (broker_lost; None: services.broker_lost_its_data, Redis back empty after a crash), its chunks still
      running or not;
    * running jobs without a new rollout for JOBS_STALL_AFTER_S are flagged stalled;
    * runnable jobs whose chunks are all done are finalized (safety path)."""
    now = now or timezone.now()
    report = {"reclaimed": [], "redispatched": [], "stalled": [], "finalized": []}

    stale_chunks = CHUNK_LEASE.expired(now).values_list("pk", "job_id", "heartbeat_at", "lease_owner")
    for chunk_id, job_id, heartbeat_at, owner in list(stale_chunks):
        if CHUNK_LEASE.reclaim(chunk_id, owner, heartbeat_at):
            # lease_owner and heartbeat_at stay: the pending chunk remembers its last holder (diagnose_stall)
            logger.warning("job %s chunk %s: lease of %s expired; handing the chunk out again", job_id, chunk_id, owner)
            report["reclaimed"].append(chunk_id)
            job = CollectionJob.objects.get(pk=job_id)
            if dispatch and job.state in JobState.RUNNABLE:
                with transaction.atomic():
                    services.dispatch_chunks(job, [chunk_id])

    if dispatch and (services.broker_lost_its_data() if broker_lost is None else broker_lost):
        # the queued chunk messages are gone: send every pending chunk of a launched job again (a chunk that
        # is leased meanwhile ignores its duplicate message)
        lost_jobs = (JobChunk.objects.filter(state=JobChunk.State.PENDING, job__state__in=JobState.RUNNABLE,
                                             dispatched_at__isnull=False).values_list("job_id", flat=True).distinct())
        for job in CollectionJob.objects.filter(pk__in=list(lost_jobs)):
            with transaction.atomic():
                ids = services.dispatch_chunks(job, JobChunk.objects.filter(job=job, state=JobChunk.State.PENDING)
                                               .values_list("pk", flat=True))
            logger.warning("job %s: the broker lost its queued messages; chunks %s sent again", job.pk, ids)
            report["redispatched"].extend(ids)

    # pending chunks whose message may be lost: only for jobs where nothing is live
    lost_before = now - timedelta(seconds=max(settings.JOBS_LEASE_TIMEOUT_S * 4, 60))
    for job in CollectionJob.objects.filter(state__in=JobState.RUNNABLE):
        chunks = JobChunk.objects.filter(job=job)
        if chunks.filter(state=JobChunk.State.RUNNING).exists():
            continue
        lost = list(chunks.filter(state=JobChunk.State.PENDING)
                    .filter(Q(dispatched_at__lt=lost_before) | Q(dispatched_at__isnull=True))
                    .values_list("pk", flat=True))
        # a job never launched to Celery (the CLI's inline runner) is left to its runner
        if lost and dispatch and chunks.exclude(dispatched_at__isnull=True).exists():
            with transaction.atomic():
                services.dispatch_chunks(job, lost)
            report["redispatched"].extend(lost)
        elif not chunks.exclude(state=JobChunk.State.DONE).exists():
            if job.open_ended and not job.open_ended.get("stopping"):  # waits for its consumer: top up if it can
                services.top_up_open_ended(job, launch=dispatch)
                continue
            if dispatch:
                services.dispatch_finalize(job)
            else:
                services.finalize_job(job)
            report["finalized"].append(job.pk)

    stall_before = now - timedelta(seconds=settings.JOBS_STALL_AFTER_S)
    candidates = (CollectionJob.objects.filter(state=JobState.RUNNING).select_related("endpoint").filter(
        Q(last_progress_at__lt=stall_before) | Q(last_progress_at__isnull=True, started_at__lt=stall_before)))
    for job in list(candidates):
        if job.open_ended and not JobChunk.objects.filter(job=job).exclude(state=JobChunk.State.DONE).exists():
            continue  # open-ended, its buffer full: it waits for its consumer, it is not stalled
        idle_since = job.last_progress_at or job.started_at
        if (now - idle_since).total_seconds() < stall_after_s(job):
            continue
        reason = diagnose_stall(job, now)
        if job.stalled and job.stall_reason == reason:
            continue
        # only while no rollout arrived meanwhile (the sink clears the flag with every batch)
        if CollectionJob.objects.filter(pk=job.pk, state=JobState.RUNNING, last_progress_at=job.last_progress_at).update(
                stalled=True, stall_reason=reason):
            if not job.stalled:
                logger.warning("job %s flagged stalled: %s", job.pk, reason)
                report["stalled"].append(job.pk)
                job.notice("job.stalled", reason)
            job.stalled, job.stall_reason = True, reason
            publish_job_state(job)
    return report

