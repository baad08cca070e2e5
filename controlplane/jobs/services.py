"""Job domain logic, callable from views, the API, tasks, admin and management commands.

CONTRACT (signatures other apps rely on): create_job, cancel_job, pause_job, resume_job, retry_failed.
Also here: refresh_counts, finalize_job, fail_job, dispatch_chunks.

Imports run one way: tasks.py (Celery entry points) -> runtime.py (the per-chunk runner and the CLI's inline
runner) -> services.py -> models / events. Services send Celery tasks by their registered name, so they
never import tasks.py.
Invalid state changes raise models.InvalidTransition (the API answers 409); invalid parameters raise
django.core.exceptions.ValidationError (400).
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Count
from django.utils import timezone

from controlplane import limits
from controlplane import operator as knobs
from controlplane.datasets.models import Dataset
from workers.engine.aggregate import AggregateAccumulator, StoredRowSummaries, TimingAccumulator
from workers.engine.types import TIMING_FIELDS

from . import openended, quantiles
from .events import publish_job_state
from .models import CollectionJob, InvalidTransition, JobChunk, JobState, Rollout, VerificationRun
from .verifier_checks import check_dataset_fields, check_verifier

logger = logging.getLogger(__name__)

RUN_CHUNK_TASK = "controlplane.jobs.tasks.run_chunk_task"
FINALIZE_JOB_TASK = "controlplane.jobs.tasks.finalize_job_task"

__all__ = [
    "create_job", "get_or_create_job", "cancel_job", "pause_job", "resume_job", "retry_failed",
    "refresh_counts", "finalize_job", "fail_job", "dispatch_chunks", "InvalidTransition", "stop_job",
]


def send_task(name, *args, queue=None):
    """Send a registered Celery task (honours task_always_eager) to `queue`, or to the default queue when None."""
    from controlplane.celery import registered_app  # Celery is imported at the first task sent, not at start

    task = registered_app().tasks[name]
    return task.apply_async(args, queue=queue) if queue else task.delay(*args)


def chunk_queue(job) -> str | None:
    """The Celery queue of a job's chunks: its endpoint's worker_queue, else settings.JOBS_ENDPOINT_QUEUES by
    endpoint name, else None (the default queue)."""
    endpoint = job.endpoint
    return (getattr(endpoint, "worker_queue", "") or settings.JOBS_ENDPOINT_QUEUES.get(endpoint.name)
            or None)


def queue_errors(job_or_endpoint) -> dict[str, str]:
    """{"endpoint": why} when the chunks would go to a queue name the broker keeps for itself (`unacked`, a
    pidbox...: an endpoint saved before the checks, or changed behind them). Endpoint saves allow only the
    operator's queues; this is checked again at job creation and right before anything is sent."""
    endpoint = getattr(job_or_endpoint, "endpoint", job_or_endpoint)
    queue = getattr(endpoint, "worker_queue", "") or ""
    why = knobs.queue_problem(queue, listed=False)
    return {"endpoint": f"this endpoint's worker queue: {why}"} if why else {}


# --- creation ----------------------------------------------------------------------------------
def _validate(*, dataset, endpoint, limit, num_repeats, num_samples_in_parallel, chunk_size, verifier, verify_mode,
              responses_create_params, verifier_options, operator=False, owner=None):
    errors = {}
    if dataset.status != Dataset.Status.READY:
        errors["dataset"] = f"dataset {dataset.pk} is {dataset.status}, not ready"
    elif dataset.row_count < 1:
        errors["dataset"] = f"dataset {dataset.pk} has no rows"
    for name, value in (("limit", limit), ("num_repeats", num_repeats),
                        ("num_samples_in_parallel", num_samples_in_parallel), ("chunk_size", chunk_size)):
        if value is None and name == "limit":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            errors[name] = f"{name} must be an integer >= 1, not {value!r}"
    if verify_mode not in CollectionJob.VerifyMode.values:
        errors["verify_mode"] = f"verify_mode must be one of {', '.join(CollectionJob.VerifyMode.values)}"
    errors.update(queue_errors(endpoint))
    if not errors.get("dataset") and isinstance(verifier_options, dict):  # verifier, options, rows' fields
        try:
            v, opts = check_verifier(verifier, verifier_options, owner, operator=operator)
            check_dataset_fields(dataset, v, opts, n_rows=limit if isinstance(limit, int) else None)
        except ValidationError as exc:
            errors.update(exc.message_dict)
    if not isinstance(responses_create_params, dict):
        errors["responses_create_params"] = "must be an object"
    if not isinstance(verifier_options, dict):
        errors["verifier_options"] = "must be an object"
    # operator bounds, shared with every way in
    errors.update(limits.job_errors(limit=limit, num_repeats=num_repeats,
                                    num_samples_in_parallel=num_samples_in_parallel, chunk_size=chunk_size))
    if errors:
        raise ValidationError(errors)


def _job_with_key(owner, idempotency_key):
    if not idempotency_key:
        return None
    return CollectionJob.objects.filter(owner=owner, idempotency_key=idempotency_key).first()


def get_or_create_job(*, owner, idempotency_key=None, **params):
    """(job, created): the owner's job with this idempotency key when there is one (also when a concurrent
    request with the same key wins the race), else a new job from `params` (see create_job)."""
    existing = _job_with_key(owner, idempotency_key)
    if existing is not None:
        return existing, False
    try:
        return _create_job(owner=owner, idempotency_key=idempotency_key, **params), True
    except IntegrityError:
        existing = _job_with_key(owner, idempotency_key)
        if existing is not None:  # lost a race with the same key
            return existing, False
        raise


def create_job(*, owner, idempotency_key=None, **params):
    """Create a CollectionJob (and its chunks) and, when launch, dispatch it to Celery. Returns the job.
    With an idempotency_key already used by this owner, returns the existing job instead."""
    return get_or_create_job(owner=owner, idempotency_key=idempotency_key, **params)[0]


def mlflow_targets() -> dict[str, str]:
    """The deployment's MLflow tracking servers, name -> URI (setting MLFLOW_TRACKING_URIS)."""
    return dict(getattr(settings, "MLFLOW_TRACKING_URIS", {}) or {})


def mlflow_target(value) -> str:
    """The name of the configured MLflow server a job's `mlflow_tracking_uri` names (by name or exact URI); "" for
    none. Anything else is refused: a user's own URI could make the workers write any path or call any address."""
    value = (value or "").strip() if isinstance(value, str) else value
    if not value:
        return ""
    known = mlflow_targets()
    if isinstance(value, str):
        if value in known:
            return value
        for name, uri in known.items():
            if value == uri:
                return name
    names = ", ".join(sorted(known)) or "none are configured"
    raise ValidationError({"mlflow_tracking_uri": f"not one of this deployment's MLflow tracking servers ({names})"})


def _create_job(*, owner, dataset, endpoint, limit=None, num_repeats=1, num_samples_in_parallel=16,
                parallelism_auto=False, responses_create_params=None, verifier="math", verifier_options=None,
                verify_mode="inline", chunk_size=5000, name="", idempotency_key=None, profiling_enabled=False,
                output_path="", launch=True, verify_cache="job", operator=False, max_version_lag=None,
                stale_policy=CollectionJob.StalePolicy.MARK, mlflow_tracking_uri="", profile_servers=False,
                open_ended=None):
    """`operator`: the caller is the operator (manage.py commands): dotted-path verifiers are allowed.
    `profile_servers`: a NeMo Gym endpoint's own servers (discovered from its head server) are profiled while the
    job runs, as collect_rollouts' +profiling_enabled does (controlplane.profiling.services.profile_run).
    `max_version_lag` / `stale_policy`: bounded staleness for the rollout stream (controlplane.jobs.stream).
    `open_ended`: {buffer, shuffle, seed, consumer} for open-ended collection (controlplane.jobs.openended):
    chunks are then made pass after pass as the buffer has room, not all now."""
    if max_version_lag is not None and (not isinstance(max_version_lag, int) or isinstance(max_version_lag, bool)
                                        or not 0 <= max_version_lag <= 2**31 - 1):
        raise ValidationError({"max_version_lag": f"max_version_lag must be an integer >= 0 or null, not {max_version_lag!r}"})
    if stale_policy not in CollectionJob.StalePolicy.values:
        raise ValidationError({"stale_policy": f"stale_policy must be recollect or mark, not {stale_policy!r}"})
    responses_create_params = {} if responses_create_params is None else responses_create_params
    verifier_options = {} if verifier_options is None else verifier_options
    mlflow_name = mlflow_target(mlflow_tracking_uri)  # one of the deployment's servers, by name or URI, or ""
    if verify_cache not in ("off", "job", "global"):
        raise ValidationError({"verify_cache": f"verify_cache must be off, job or global, not {verify_cache!r}"})
    _validate(dataset=dataset, endpoint=endpoint, limit=limit, num_repeats=num_repeats,
              num_samples_in_parallel=num_samples_in_parallel, chunk_size=chunk_size, verifier=verifier,
              verify_mode=verify_mode, responses_create_params=responses_create_params,
              verifier_options=verifier_options, operator=operator, owner=owner)
    options = {"mlflow": mlflow_name} if mlflow_name else {}
    if profile_servers:
        if not endpoint.is_nemo_gym:
            raise ValidationError({"profile_servers": "only a NeMo Gym endpoint (kind nemo_gym) has servers to profile"})
        options["profile_servers"] = True
        profiling_enabled = True  # the job's profiling session holds the servers' windows
    n_rows = min(limit, dataset.row_count) if limit else dataset.row_count
    open_ended = openended.options_for(open_ended, dataset=dataset, limit=limit, num_repeats=num_repeats,
                                       chunk_size=chunk_size)
    with transaction.atomic():
        limits.lock_owner(owner)  # the quota is checked and taken under the lock: concurrent requests wait
        if quota := limits.quota_errors(owner, num_samples_in_parallel):
            raise ValidationError(quota)
        job = CollectionJob.objects.create(
            owner=owner, name=name, dataset=dataset, endpoint=endpoint, limit=limit, num_repeats=num_repeats,
            num_samples_in_parallel=num_samples_in_parallel, parallelism_auto=parallelism_auto,
            responses_create_params=responses_create_params, verifier=verifier,
            verifier_options=verifier_options, verify_mode=verify_mode, chunk_size=chunk_size,
            idempotency_key=idempotency_key or None, profiling_enabled=profiling_enabled,
            output_path=output_path, total_rollouts=0 if open_ended else n_rows * num_repeats,
            verify_cache=verify_cache, max_version_lag=max_version_lag, stale_policy=stale_policy,
            collection_options=options, open_ended=open_ended,
        )
        if open_ended:  # the first chunks, as many as the buffer takes (then as the consumer acknowledges)
            top_up_open_ended(job, launch=launch)
            job.refresh_from_db(fields=["total_rollouts"])
            return job
        JobChunk.objects.bulk_create(
            [JobChunk(job=job, index=i, start_row=start, end_row=min(start + chunk_size, n_rows))
             for i, start in enumerate(range(0, n_rows, chunk_size))],
            batch_size=1000,
        )
        if launch:
            dispatch_chunks(job)
    return job


# --- dispatch ----------------------------------------------------------------------------------
def dispatch_chunks(job, chunk_ids=None):
    """Send one Celery task per unfinished chunk (or the given ones), after the transaction commits.
    Safe to repeat: a chunk is leased atomically, so a duplicate message is a no-op."""
    qs = JobChunk.objects.filter(job=job).exclude(state=JobChunk.State.DONE)
    if chunk_ids is not None:
        qs = qs.filter(pk__in=list(chunk_ids))
    ids = list(qs.order_by("index").values_list("pk", flat=True))
    if not ids:
        return []
    if refused := queue_errors(job):  # never push a chunk onto a key the broker keeps for itself
        logger.error("job %s: not dispatched: %s", job.pk, refused["endpoint"])
        fail_job(job, f"Not dispatched: {refused['endpoint']}")
        return []
    JobChunk.objects.filter(pk__in=ids).update(dispatched_at=timezone.now())
    queue = chunk_queue(job)

    def send():
        for chunk_id in ids:
            send_task(RUN_CHUNK_TASK, chunk_id, queue=queue)

    # robust: a broker outage is logged, not raised after the job was committed; the watchdog re-sends.
    transaction.on_commit(send, robust=True)
    return ids


def broker_mark_key() -> str:
    """One mark per control plane (its database): several may share one Redis, each must see a loss."""
    return f"controlplane:broker-mark:{settings.DATABASES['default']['NAME']}"


def broker_lost_its_data() -> bool:
    """Whether the broker's Redis lost what it held since the last call (restarted with nothing saved, flushed,
    failed over to an empty replica): the mark the last call left there is gone. Every message sent before the
    loss (chunks still queued, finalizations) is gone with it. Only one caller sees a given loss (SET NX). The
    first call on a new Redis finds no mark either: re-sending then is harmless, a chunk's lease makes a
    duplicate message a no-op. False when the broker is not Redis or cannot be reached."""
    url = settings.CELERY_BROKER_URL or ""
    if settings.CELERY_TASK_ALWAYS_EAGER or not url.startswith(("redis://", "rediss://", "unix://")):
        return False
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        try:
            return bool(client.set(broker_mark_key(), timezone.now().isoformat(), nx=True))
        finally:
            client.close()
    except redis.RedisError as exc:
        logger.warning("could not check the broker for lost messages: %s", exc)
        return False


def dispatch_finalize(job):
    """Send the finalization of `job` to Celery after the transaction commits."""
    transaction.on_commit(lambda job_id=job.pk: send_task(FINALIZE_JOB_TASK, job_id))


# --- control -----------------------------------------------------------------------------------
def _locked(job):
    return CollectionJob.objects.select_for_update().get(pk=job.pk)


def _sync(job, fresh):
    """Copy the fresh row's fields onto the caller's instance, so callers see the new state."""
    for f in CollectionJob._meta.concrete_fields:
        setattr(job, f.attname, getattr(fresh, f.attname))
    return job


def _transition(job, name):
    """Apply the model's transition `name` to the locked row, then sync the caller's instance and publish."""
    with transaction.atomic():
        fresh = _locked(job)
        getattr(fresh, name)()
    _sync(job, fresh)
    publish_job_state(job)
    return job


def cancel_job(job):
    """Cancel; running workers stop within ~1 s. Raises models.InvalidTransition when it does not fit."""
    return _transition(job, "cancel")


def stop_job(job):
    """Stop an open-ended job: the chunks in flight finish, no more are made, and it completes with the last
    (controlplane.jobs.openended). InvalidTransition for another job (cancel it) or one not running."""
    fresh, open_chunks = openended.mark_stopping(job)
    if not open_chunks:  # nothing in flight (the buffer was full): it completes now
        finalize_job(fresh)
    job.refresh_from_db()
    publish_job_state(job)
    return job


def top_up_open_ended(job, launch: bool = True) -> list[int]:
    """An open-ended job's next chunks while its buffer has room (openended.add_chunks), dispatched when
    `launch`. Returns their ids. Runs when a chunk is done, when the consumer's cursor moves, at resume and from
    the watchdog; a job that is not open-ended, stopping or not runnable gets none."""
    fresh, ids = openended.add_chunks(job)
    if launch and ids:
        with transaction.atomic():
            dispatch_chunks(fresh, ids)
    return ids


def after_stream_ack(job) -> None:
    """A consumer's cursor moved (a batch acknowledged, failed or left-out rows passed): room in an open-ended
    job's buffer, perhaps (add_chunks checks the job's state under its lock)."""
    if job.open_ended:
        top_up_open_ended(job)


def pause_job(job):
    """Pause; running workers stop taking new rows within ~1 s, and their chunks go back to pending."""
    return _transition(job, "pause")


def _check_quota_to_reactivate(job):
    """A paused or finished job that becomes queued again counts against its owner's quota like a new one
    (else pausing and resuming would get round it). Locks the owner's row first, then the job's, as creation."""
    if job.owner_id is None:
        return
    limits.lock_owner(job.owner)
    state = CollectionJob.objects.filter(pk=job.pk).values_list("state", flat=True).first()
    if state not in (JobState.QUEUED, JobState.RUNNING):
        if quota := limits.quota_errors(job.owner, job.num_samples_in_parallel):
            raise ValidationError(quota)


def resume_job(job, launch=True):
    """Resume a paused, failed or cancelled job: re-dispatch unfinished chunks (exactly-once).
    With launch=False (the CLI's inline runner) nothing is sent to Celery."""
    if launch and (refused := queue_errors(job)):
        raise ValidationError(refused)
    with transaction.atomic():
        _check_quota_to_reactivate(job)
        fresh = _locked(job)
        fresh.resume()
        if launch:
            if not dispatch_chunks(fresh):
                dispatch_finalize(fresh)  # every chunk was already done: only the finalization is missing
    _sync(job, fresh)
    publish_job_state(job)
    return job


def retry_failed(job, launch=True, only=None):
    """Delete the job's failed rollouts (`only`: those of these primary keys) and collect those (task, repeat)
    pairs again.

    Chunks are reopened and re-run; each chunk skips the pairs already stored, so only the deleted
    (failed) pairs are collected again."""
    if launch and (refused := queue_errors(job)):
        raise ValidationError(refused)
    with transaction.atomic():
        _check_quota_to_reactivate(job)
        fresh = _locked(job)
        fresh._check("retry_failed")
        failed = Rollout.objects.filter(job=fresh, status=Rollout.Status.FAILED)
        deleted, _ = (failed if only is None else failed.filter(pk__in=list(only))).delete()
        JobChunk.objects.filter(job=fresh).update(state=JobChunk.State.PENDING, lease_owner="", heartbeat_at=None,
                                                  finished_at=None)
        refresh_counts(fresh)
        fresh.reopen_for_retry()
        if launch:
            dispatch_chunks(fresh)
    _sync(job, fresh)
    logger.info("job %s: retrying %d failed rollouts", job.pk, deleted)
    publish_job_state(job)
    return job


# --- counts and finalization -------------------------------------------------------------------
def refresh_counts(job):
    """Recompute completed/failed from the rollouts table (the source of truth) and save them."""
    counts = dict(Rollout.objects.filter(job_id=job.pk).values_list("status").annotate(n=Count("id")).order_by())
    job.completed_count = counts.get(Rollout.Status.OK, 0)
    job.failed_count = counts.get(Rollout.Status.FAILED, 0)
    CollectionJob.objects.filter(pk=job.pk).update(completed_count=job.completed_count, failed_count=job.failed_count)
    return job


def compute_summaries(job, batch_size=2000):
    """(aggregate_metrics, timing_summary) over the job's stored rows, streamed in constant memory: sums,
    counts, min and max here, medians and percentiles from the database (quantiles), so the worker holds no
    per-rollout value however big the job. Aggregates are over the successful output rows (NeMo Gym's
    output file); timings over every row."""
    agg = AggregateAccumulator(ordered_by_task=True, keep_values=False)
    timing = TimingAccumulator(keep_values=False)
    # (task, repeat) order walks the unique index and lets the accumulator fold each finished task
    qs = (Rollout.objects.filter(job_id=job.pk).order_by("task_index", "rollout_index")
          .values_list("status", "data", "failure_class", *TIMING_FIELDS))
    for status, data, _failure_class, *timings in qs.iterator(chunk_size=batch_size):
        timing.add(**dict(zip(TIMING_FIELDS, timings)))
        if status == Rollout.Status.OK:
            agg.add(data)
    return (agg.result(medians=lambda key, n: quantiles.field_median(job.pk, key, n)),
            timing.result(percentiles=lambda name, n: quantiles.timing_percentiles(job.pk, name, n)))


def feed_summaries(summaries: StoredRowSummaries, rows: list[dict]) -> None:
    """DbSink.on_stored's rows (sink._rollout_values) into a StoredRowSummaries (see finalize_job)."""
    for r in rows:
        summaries.add(r["status"] == Rollout.Status.OK, r["data"], r["rollout_index"],
                      {name: r[name] for name in TIMING_FIELDS})


def finalize_job(job, launch=True, summaries=None):
    """When every chunk is done: store aggregate metrics and the timing summary, then complete; a `fast` job
    gets its exact pass (a batch verification run) in the same transaction, sent to a worker when `launch`
    (the CLI's inline runner runs it itself). Idempotent and safe to call from several workers at once.
    Returns the job (refreshed). An open-ended job that is not stopping runs on: its next chunks are added
    instead, as its buffer has room (top_up_open_ended). `summaries`: a StoredRowSummaries fed with every row
    this process stored; used instead of reading the table back when they are exactly its rows."""
    job.refresh_from_db(fields=["open_ended"])
    if openended.is_waiting(job):
        top_up_open_ended(job, launch=launch)
        job.refresh_from_db()
        return job
    if job.state not in JobState.RUNNABLE or JobChunk.objects.filter(job_id=job.pk).exclude(state=JobChunk.State.DONE).exists():
        job.refresh_from_db()
        if job.state not in JobState.RUNNABLE or JobChunk.objects.filter(job_id=job.pk).exclude(state=JobChunk.State.DONE).exists():
            return job
    fed = summaries.result(Rollout.objects.filter(job_id=job.pk).count()) if summaries is not None else None
    aggregate_metrics, timing_summary = fed or compute_summaries(job)
    from .nemo_gym import with_agent_aggregates  # a NeMo Gym job: the agents' own /aggregate_metrics too

    aggregate_metrics = with_agent_aggregates(job, aggregate_metrics)
    with transaction.atomic():
        fresh = _locked(job)
        if (fresh.state not in JobState.RUNNABLE or openended.is_waiting(fresh)
                or JobChunk.objects.filter(job_id=job.pk).exclude(state=JobChunk.State.DONE).exists()):
            return _sync(job, fresh)
        refresh_counts(fresh)
        fresh.aggregate_metrics = aggregate_metrics
        fresh.timing_summary = timing_summary
        fresh.save(update_fields=["aggregate_metrics", "timing_summary"])
        fresh.complete()
        if fresh.verify_mode == CollectionJob.VerifyMode.FAST and fresh.verifier not in ("", "none"):
            try:  # the job's own verifier, checked when the job was created (an operator's dotted path too)
                _, options = check_verifier(fresh.verifier, fresh.verifier_options, fresh.owner, operator=True)
            except ValidationError as exc:  # the verifier went away since launch: say so, keep the job
                logger.error("job %s: no exact pass: %s", job.pk, exc)
            else:
                create_verification_run(fresh, fresh.verifier, options, trigger="fast_exact_pass", launch=launch)
    _sync(job, fresh)
    logger.info("job %s completed: %d ok, %d failed", job.pk, job.completed_count, job.failed_count)
    publish_job_state(job)
    return job


VERIFY_JOB_TASK = "controlplane.jobs.tasks.verify_job_task"


def dispatch_verification(run):
    # robust: a broker outage is logged, not raised after the run was committed; the watchdog re-sends
    transaction.on_commit(lambda: send_task(VERIFY_JOB_TASK, run.pk), robust=True)


def create_verification_run(job, verifier, options, *, trigger="user", launch=True):
    """A batch verification run over the job's stored rollouts (verification.run_verification runs it), sent
    to a worker after the transaction commits when `launch`. `trigger`: "user" or "fast_exact_pass"."""
    with transaction.atomic():
        run = VerificationRun.objects.create(
            job=job, verifier=verifier, verifier_options=options, info={"trigger": trigger},
            total=Rollout.objects.filter(job=job, status=Rollout.Status.OK).count()
            + Rollout.objects.filter(job=job, failure_class="verifier_error").count())
        if launch:
            dispatch_verification(run)
    return run


def fail_job(job, message):
    """Fail the job with a user-facing message unless it already reached another end state."""
    with transaction.atomic():
        fresh = _locked(job)
        if fresh.state in JobState.UNFINISHED:
            fresh.fail(message)
    _sync(job, fresh)
    publish_job_state(job)
    return job


def active_jobs_work(owner) -> tuple[int, int]:
    """(how many, total parallelism) of the user's queued and running jobs, for the quotas (limits.py)."""
    from django.db.models import Sum

    jobs = CollectionJob.objects.filter(owner=owner, state__in=[JobState.QUEUED, JobState.RUNNING])
    return jobs.count(), jobs.aggregate(p=Sum("num_samples_in_parallel"))["p"] or 0
