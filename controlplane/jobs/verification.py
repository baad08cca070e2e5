"""Batch verification of a job's stored rollouts ("verify this job"): for deferred jobs (collected
without verification), fast jobs (a cheap heuristic during collection; the exact verifier here), or to
re-verify. Runs with its own, much higher parallelism than collection: a process pool of
VERIFY_JOB_PROCESSES for CPU verifiers, VERIFY_JOB_CONCURRENCY threads / calls for io and remote ones.

Resumable and exactly-once like a chunk: a VerificationRun is leased with a heartbeat (the chunks' protocol,
controlplane.leases: models.VERIFICATION_LEASE); each batch of rollouts gets its new rewards and the run's
cursor (the last rollout id done) in one transaction, guarded by the lease. A killed worker stops
heartbeating; the watchdog hands the run out again and the new holder starts after the cursor. When the last
batch is in, counts and aggregate metrics are recomputed.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.leases import HeartbeatThread
from controlplane.telemetry import record_verify_batch
from workers.engine.convert import response_text
from workers.verifiers.execution import VerifyExecutor, verify_items

from . import services
from .events import publish_job_state
from .models import (
    VERIFICATION_LEASE, CollectionJob, InvalidTransition, JobMetricSample, JobState, Rollout, VerificationRun,
)
from .verify_cache import verify_cache_spec
from .verifier_checks import bind_options, check_verifier

logger = logging.getLogger(__name__)

BATCH = 500
_OUTPUT_KEYS = {"response", "reward", "_ng_task_index", "_ng_rollout_index"}


# --- starting --------------------------------------------------------------------------------
def start_verification(job, *, verifier=None, verifier_options=None, launch=True, trigger="user",
                       operator=False) -> VerificationRun:
    """Verify a finished job's stored rollouts (the job's own verifier unless another is given). An
    active run of the job is returned as is. `trigger`: "user", or "fast_exact_pass" (started by the
    job's completion in fast mode). `operator`: asked for by the operator (manage.py verify_job), who may
    name any dotted path; users name what controlplane.operator allows (the job's own verifier too)."""
    existing = VerificationRun.objects.filter(job=job, state__in=[VerificationRun.State.PENDING,
                                                                  VerificationRun.State.RUNNING]).first()
    if existing is not None:
        return existing
    if job.state != JobState.COMPLETED:
        raise InvalidTransition(f"cannot verify a job that is {job.state}: verification runs over a completed job")
    name = verifier or job.verifier
    if not name or name == "none":
        raise ValidationError({"verifier": "the job has no verifier: name one to verify with"})
    _, options = check_verifier(name, job.verifier_options if verifier_options is None and not verifier else verifier_options or {},
                                job.owner, operator=operator)
    return services.create_verification_run(job, name, options, trigger=trigger, launch=launch)


VERIFY_JOB_TASK = services.VERIFY_JOB_TASK
dispatch = services.dispatch_verification


def run_pending(job, worker_name="") -> list[str]:
    """Run the job's pending verification runs in this process (the CLI's inline path: a fast job's exact
    pass). A run another worker holds is left to it."""
    return [run_verification(pk, worker_name or "inline-verify")
            for pk in VerificationRun.objects.filter(job=job, state=VerificationRun.State.PENDING)
            .order_by("created_at").values_list("pk", flat=True)]


# --- lease (controlplane.leases) ------------------------------------------------------------
def reclaim_stale(dispatch_again=True, broker_lost=False) -> list[int]:
    """Watchdog: runs whose worker stopped heartbeating go back to pending and are sent again; a pending run
    nobody took for a while (a message lost in a broker outage) is sent again (a duplicate finds it leased),
    every pending run at once when the broker lost its data (services.broker_lost_its_data)."""
    out = []
    lost_before = timezone.now() - timedelta(seconds=max(settings.JOBS_LEASE_TIMEOUT_S * 4, 60))
    if broker_lost:
        lost_before = timezone.now()
    for run in VerificationRun.objects.filter(state=VerificationRun.State.PENDING, created_at__lt=lost_before).filter(
            Q(heartbeat_at__lt=lost_before) | Q(heartbeat_at__isnull=True)):
        # heartbeat_at of a pending run: when it was last re-sent, so it is re-sent once per period at most
        if VerificationRun.objects.filter(pk=run.pk, state=VerificationRun.State.PENDING).update(heartbeat_at=timezone.now()):
            logger.warning("verification run %s of job %s: still pending; sending it again", run.pk, run.job_id)
            out.append(run.pk)
            if dispatch_again:
                with transaction.atomic():
                    dispatch(run)
    for run in VERIFICATION_LEASE.expired():
        if VERIFICATION_LEASE.reclaim(run.pk, run.lease_owner, run.heartbeat_at, lease_owner=""):
            logger.warning("verification run %s of job %s: lease of %s expired; handing it out again",
                           run.pk, run.job_id, run.lease_owner)
            out.append(run.pk)
            if dispatch_again:
                with transaction.atomic():
                    dispatch(run)
    return out


# --- running --------------------------------------------------------------------------------
def _pool(size):
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=size, mp_context=ctx)


def _input_row(data: dict, verifier_fields: set) -> dict:
    return {k: v for k, v in data.items() if k not in _OUTPUT_KEYS and k not in verifier_fields}


def _pool_one(pool):
    """The executor's `pooled` hook for single items (keys another worker was computing when it gave up)."""
    async def one(name, row, text, options, fast):
        (res,) = await asyncio.get_running_loop().run_in_executor(pool, verify_items, [(name, row, text, options, fast)])
        if not res[0]:
            raise RuntimeError(f"{res[1]}: {res[2]}")
        return res[1]
    return one


async def _verify_batch(ex: VerifyExecutor, pool, items):
    """[(True, VerifyResult) | (False, type, msg)] for [(row, text)]."""
    if ex.kind == "cpu" and pool is not None:
        loop = asyncio.get_running_loop()
        per = max(1, len(items) // (pool._max_workers * 4))
        # cache first (identical work once: in this batch, then in the shared cache), the rest to the pool in slices
        keys, todo, results = {}, [], [None] * len(items)
        for i, (row, text) in enumerate(items):
            if ex.cache_mode != "off":
                k = ex.key(row, text)
                ex.lookups += 1
                if k in keys:
                    ex.hits += 1
                    keys[k].append(i)
                    continue
                keys[k] = [i]
            todo.append(i)
        busy = set()
        mine = set()
        if ex.shared is not None and keys:
            try:
                found, mine, busy = await ex.shared.get_or_claim_many(list(keys))
            except Exception as exc:  # noqa: BLE001
                ex.shared_failed(exc)
                found = {}
            for k, res in found.items():
                ex.hits += 1
                results[keys[k][0]] = (True, res)
            todo = [keys[k][0] for k in keys if k in mine] if ex.shared is not None else todo
        slices = [todo[j:j + per] for j in range(0, len(todo), per)]
        futs = [loop.run_in_executor(pool, verify_items, [(ex.name, items[i][0], items[i][1], ex.options, ex.fast)
                                                          for i in sl]) for sl in slices]
        for sl, out in zip(slices, await asyncio.gather(*futs)):
            for i, res in zip(sl, out):
                results[i] = res
        if ex.shared is not None and mine:
            key_of = {keys[k][0]: k for k in mine}
            done = {key_of[i]: results[i][1] for i in todo if i in key_of and results[i][0]}
            try:
                await ex.shared.put_many(done)
                await ex.shared.release_many(k for k in mine if k not in done)  # errors are not cached
            except Exception as exc:  # noqa: BLE001
                ex.shared_failed(exc)
        for k in busy:  # another worker is computing these: wait for its result (or take over)
            i = keys[k][0]
            try:
                res = await ex.resolve(k, *items[i])
                results[i] = (True, res)
            except Exception as exc:  # noqa: BLE001
                results[i] = (False, type(exc).__name__, str(exc))
        if ex.cache_mode != "off":
            for idxs in keys.values():
                for i in idxs[1:]:
                    results[i] = results[idxs[0]]
        return results

    async def one(row, text):
        try:
            return (True, await ex.verify(row, text))
        except Exception as exc:  # noqa: BLE001
            return (False, type(exc).__name__, str(exc))
    return await asyncio.gather(*(one(r, t) for r, t in items))


def run_verification(run_id, worker_name="", batch_size=BATCH, stop_after_batches=None) -> str:
    """Run (or resume) one verification run to its end. Returns "done", "busy", "skipped", "lost_lease"
    or "failed"; "deadline" when its total deadline (JOBS_CHUNK_DEADLINE_S) handed it back, pending and sent
    again, to resume at its cursor (with nothing verified by then it fails with the reason).
    `stop_after_batches` stops early (for tests of resumption)."""
    run = VerificationRun.objects.select_related("job").filter(pk=run_id).first()
    if run is None or run.state in (VerificationRun.State.DONE, VerificationRun.State.FAILED):
        return "skipped"
    lease = f"{worker_name or 'verify'}#{uuid.uuid4().hex[:8]}"
    now = timezone.now()
    if not VERIFICATION_LEASE.claim(run_id, lease, now=now, started_at=now):
        return "busy"
    run.refresh_from_db()
    job = run.job
    try:
        cache_spec = verify_cache_spec(job)
        ex = VerifyExecutor(run.verifier, bind_options(run.verifier, run.verifier_options, job.owner),
                            cache=job.verify_cache or "job",
                            concurrency=settings.VERIFY_JOB_CONCURRENCY, shared_url=cache_spec["verify_cache_url"],
                            shared_scope=cache_spec["verify_cache_scope"], shared_ttl_s=cache_spec["verify_cache_ttl_s"],
                            shared_claim_s=cache_spec["verify_cache_claim_s"])
        verifier_fields = set()
        fast_job = job.verify_mode == CollectionJob.VerifyMode.FAST and run.info.get("trigger") == "fast_exact_pass"
        pool = _pool(settings.VERIFY_JOB_PROCESSES) if ex.kind == "cpu" else None
        if pool is not None:
            ex.pooled = _pool_one(pool)
        info = getattr(ex.verifier, "runtime_info", None)
        if info is not None:  # the code verifier: the sandbox its programs get (or why there is none)
            run.info.update(info())
        run.info.update(kind=ex.kind, processes=settings.VERIFY_JOB_PROCESSES if pool else None,
                        concurrency=ex.concurrency if ex.kind in ("io", "remote") else None)
        VERIFICATION_LEASE.held(run.pk, lease).update(info=run.info)
        loop = asyncio.new_event_loop()
        heartbeat = HeartbeatThread(VERIFICATION_LEASE, run.pk, lease, name=f"verify-heartbeat-{run.pk}")
        heartbeat.start()
        batches = 0
        t0, done0 = time.monotonic(), run.verified
        deadline_s = settings.JOBS_CHUNK_DEADLINE_S  # Celery's time limits are not enforced under threads
        try:
            while True:
                remaining = deadline_s - (time.monotonic() - t0)
                if remaining <= 0 and run.verified > done0:  # hand the run back: it resumes at its cursor
                    if VERIFICATION_LEASE.release(run.pk, lease, lease_owner=""):
                        dispatch(run)
                        logger.warning("verification run %s: handed back at its total deadline of %g s",
                                       run.pk, deadline_s)
                    return "deadline"
                qs = (Rollout.objects.filter(job=job, id__gt=run.cursor)
                      .filter(Q(status=Rollout.Status.OK) | Q(failure_class="verifier_error"))
                      .order_by("id"))
                rollouts = list(qs[:batch_size])
                if not rollouts:
                    break
                items = [(_input_row(r.data, verifier_fields), response_text(r.data.get("response") or {}))
                         for r in rollouts]
                hits0, lookups0 = ex.hits, ex.lookups
                try:
                    results = loop.run_until_complete(asyncio.wait_for(_verify_batch(ex, pool, items),
                                                                       max(remaining, 0.001)))
                except asyncio.TimeoutError:
                    if run.verified > done0:
                        continue  # the deadline hands the run back above, this batch not written
                    raise TimeoutError(f"no batch of {len(items)} verifications finished within the run's total "
                                       f"deadline of {deadline_s:g} s (JOBS_CHUNK_DEADLINE_S)") from None
                errors = 0
                agree = run.info.setdefault("fast_agreement", {"same": 0, "compared": 0}) if fast_job else None
                for r, res in zip(rollouts, results):
                    data = dict(r.data)
                    if fast_job and "fast_reward" not in data and r.reward is not None:
                        data["fast_reward"] = r.reward  # the heuristic's reward, kept beside the exact one
                    if res[0]:
                        vr = res[1]
                        data["reward"] = float(vr.reward)
                        data.update(vr.fields or {})
                        verifier_fields.update(vr.fields or {})
                        r.reward, r.status, r.failure_class, r.error = float(vr.reward), Rollout.Status.OK, "", ""
                    else:
                        errors += 1
                        data["reward"] = 0.0
                        r.reward, r.status, r.failure_class = 0.0, Rollout.Status.FAILED, "verifier_error"
                        r.error = f"verifier {run.verifier!r} raised {res[1]}: {res[2]}"[:2000]
                    r.data = data
                    if agree is not None and data.get("fast_reward") is not None:
                        agree["compared"] += 1
                        agree["same"] += data["fast_reward"] == data["reward"]
                write_t0 = time.perf_counter()
                with transaction.atomic():
                    if not VERIFICATION_LEASE.held(run.pk, lease).update(
                            info=run.info,
                            cursor=rollouts[-1].id, verified=F("verified") + len(rollouts), errors=F("errors") + errors,
                            cache_hits=F("cache_hits") + ex.hits - hits0,
                            cache_lookups=F("cache_lookups") + ex.lookups - lookups0, heartbeat_at=timezone.now()):
                        return "lost_lease"  # another worker took over: this batch is rolled back
                    Rollout.objects.bulk_update(rollouts, ["reward", "status", "failure_class", "error", "data"],
                                                batch_size=500)
                record_verify_batch(time.perf_counter() - write_t0, len(rollouts))
                run.cursor = rollouts[-1].id
                run.verified += len(rollouts)
                batches += 1
                elapsed = time.monotonic() - t0
                run.info["rollouts_per_s"] = round((run.verified - done0) / elapsed, 1) if elapsed > 0 else None
                VERIFICATION_LEASE.held(run.pk, lease).update(info=run.info)
                if stop_after_batches is not None and batches >= stop_after_batches:
                    return "stopped"
        finally:
            heartbeat.stop.set()
            loop.run_until_complete(ex.aclose())
            loop.close()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        services.refresh_counts(job)
        aggregate_metrics, timing_summary = services.compute_summaries(job)
        CollectionJob.objects.filter(pk=job.pk).update(aggregate_metrics=aggregate_metrics)
        if not VERIFICATION_LEASE.held(run.pk, lease).update(
                state=VerificationRun.State.DONE, finished_at=timezone.now(), heartbeat_at=timezone.now()):
            return "lost_lease"
        job.refresh_from_db()
        publish_job_state(job)
        logger.info("job %s verified: %d rollouts (%d verifier errors) by %s", job.pk, run.verified, run.errors,
                    run.verifier)
        return "done"
    except Exception as exc:
        logger.exception("verification run %s failed", run_id)
        VERIFICATION_LEASE.held(run_id, lease).update(
            state=VerificationRun.State.FAILED, error_message=f"{type(exc).__name__}: {exc}"[:5000],
            finished_at=timezone.now())
        return "failed"


def summary(job) -> dict | None:
    """The job page's / API's view of its latest verification run."""
    run = VerificationRun.objects.filter(job=job).order_by("-created_at").first()
    if run is None:
        return None
    return {"id": run.pk, "state": run.state, "verifier": run.verifier, "verified": run.verified, "total": run.total,
            "errors": run.errors, "cache_hit_rate": (run.cache_hits / run.cache_lookups) if run.cache_lookups else None,
            "attempts": run.attempts, "info": run.info, "error": run.error_message,
            "started_at": run.started_at, "finished_at": run.finished_at}


def collection_cache(job) -> dict:
    """Cache figures of the collection runs (inline / fast verification): the last tick of each run."""
    hits = lookups = 0
    shared, errors, sandboxes = False, set(), set()
    # order_by(): the model's default ordering (job, t) would put t into the DISTINCT and repeat each series
    for worker in JobMetricSample.objects.filter(job=job).order_by().values_list("worker", flat=True).distinct():
        last = JobMetricSample.objects.filter(job=job, worker=worker).order_by("-t").values_list("extra", flat=True).first()
        hits += int((last or {}).get("verify_cache_hits") or 0)
        lookups += int((last or {}).get("verify_cache_lookups") or 0)
        shared = shared or bool((last or {}).get("verify_cache_shared"))
        if (last or {}).get("verify_cache_error"):
            errors.add(last["verify_cache_error"])
        if (last or {}).get("verify_sandbox"):
            sandboxes.add(str(last["verify_sandbox"]))
    return {"hits": hits, "lookups": lookups, "hit_rate": hits / lookups if lookups else None, "shared": shared,
            "errors": sorted(errors), "sandboxes": sorted(sandboxes), "sandbox_note": sandbox_note(sandboxes)}


def sandbox_note(sandboxes) -> str:
    """What a page says when the code verifier's programs ran without the namespace sandbox."""
    if any(s.startswith("unavailable") for s in sandboxes):
        return "no namespace sandbox on a worker: code verification is refused there"
    if any(s != "bubblewrap" for s in sandboxes):
        return ("rlimits only, the operator's choice: programs can read what the worker's user can read and "
                "reach the network")
    return ""


def panel_context(job) -> dict:
    run = summary(job)
    return {"run": run, "collection_cache": collection_cache(job),
            "can_verify": job.state == JobState.COMPLETED and job.verifier not in ("", "none")
            and not (run and run["state"] in ("pending", "running")),
            "needs_verify": job.verify_mode in ("deferred", "fast") and not (run and run["state"] == "done")}
