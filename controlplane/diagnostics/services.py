"""Diagnostics services: evidence for a job from stored data -> the classifier; parallelism sweeps; and
what a job run needs to carry telemetry and the adaptive controller.

Evidence comes from what the jobs runtime already stores:
- JobMetricSample rows (one per progress tick per worker): counts, in-flight, parallelism, errors by class,
  and `extra["telemetry"]` (worker CPU / loop lag / GPU / vLLM /metrics, written by TelemetrySink) and
  `extra["adaptive"]` (the controller's decisions);
- Rollout rows: exact timing means (queue / TTFT / generation / verify / wall) and failure classes;
- the job and endpoint configuration (parallelism, RPM limit, timeouts, max_output_tokens, verifier);
- the latest completed ParallelismSweep on the same endpoint, when there is one.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict

from django.conf import settings
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Avg, Count, Q
from django.utils import timezone

from controlplane import limits
from controlplane.datasets.services import iter_rows
from controlplane.endpoints.services import endpoint_spec
from controlplane.jobs import figures
from controlplane.jobs.models import JobMetricSample, JobState, Rollout
from controlplane.jobs.verifier_checks import bind_options, check_verifier
from controlplane.profiling.services import profile_top
from workers.diagnosis import Diagnosis, build_evidence, diagnose
from workers.engine.types import TIMING_FIELDS, CollectionSpec
from workers.sweep import run_sweep as engine_sweep

from .models import ParallelismSweep

logger = logging.getLogger(__name__)

MAX_SAMPLES = 1200  # newest metric samples considered (about 20 minutes of one worker at 1 tick/s)


# ------------------------------------------------------------------------------------------ evidence
def job_config(job) -> dict:
    ep = job.endpoint
    rcp = job.responses_create_params or {}
    max_out = rcp.get("max_output_tokens") or rcp.get("max_tokens") or rcp.get("max_completion_tokens")
    return {
        "parallelism": job.effective_parallelism,
        "rpm_limit": getattr(ep, "rpm_limit", None),
        "request_timeout_s": getattr(ep, "request_timeout_s", None),
        "max_output_tokens": max_out if isinstance(max_out, int) else None,
        "verifier": job.verifier,
        "verify_mode": job.verify_mode,
        # the server's settings as the user states them (per replica): an attribute of the endpoint when it
        # has one, else its last health report; the diagnosis also reads them from /metrics
        "max_num_seqs": getattr(ep, "max_num_seqs", None) or (getattr(ep, "last_health", None) or {}).get("max_num_seqs"),
        "max_model_len": getattr(ep, "max_model_len", None) or (getattr(ep, "last_health", None) or {}).get("max_model_len"),
        "replicas": len(ep.all_base_urls) if ep is not None else None,
        "failure_reason": job.error_message if job.state == JobState.FAILED else "",
    }


RECENT_ROLLOUTS = 20000  # a running job's timing means come from its newest rollouts: bounded cost, current behaviour


def rollout_stats(job) -> dict:
    """Counts, timing means and failures by class for a job: a finished job's means come from its
    stored timing summary; a running job's from its newest RECENT_ROLLOUTS rows (bounded work on a
    job of any size, and what the job is doing now rather than since it began). Counts come from the
    job's counters; failures by class read the (job, status, failure_class) index only."""
    qs = Rollout.objects.filter(job_id=job.pk)
    out = {"n": job.completed_count + job.failed_count, "ok": job.completed_count, "failed": job.failed_count}
    summary = job.timing_summary or {}
    if job.state in JobState.TERMINAL and summary.get("wall_ms", {}).get("mean") is not None:
        for f in TIMING_FIELDS:
            out[f] = (summary.get(f) or {}).get("mean")
    else:
        floor = qs.order_by("-id").values_list("id", flat=True)[RECENT_ROLLOUTS - 1:RECENT_ROLLOUTS].first()
        recent = qs.filter(id__gte=floor) if floor is not None else qs
        agg = recent.aggregate(**{f: Avg(f, filter=Q(status=Rollout.Status.OK)) for f in TIMING_FIELDS})
        for f in TIMING_FIELDS:
            out[f] = agg[f]
    running_s = figures.running_seconds(job)
    if running_s:
        out["running_s"] = running_s  # the evidence's duration and throughput: the job's own figures
    out["failure_classes"] = dict(qs.filter(status=Rollout.Status.FAILED).values_list("failure_class")
                                  .annotate(c=Count("id")).order_by())
    return out


def job_ticks(job, limit: int = MAX_SAMPLES) -> list[dict]:
    rows = list(JobMetricSample.objects.filter(job_id=job.pk).order_by("-t")
                .values("worker", "t", "elapsed_s", "completed", "failed", "in_flight", "parallelism",
                        "samples_per_s", "output_tokens_per_s", "errors", "extra")[:limit])
    rows.reverse()
    return rows


def latest_sweep(job) -> ParallelismSweep | None:
    return (ParallelismSweep.objects.filter(endpoint_id=job.endpoint_id, state=ParallelismSweep.State.COMPLETED)
            .order_by("-finished_at").first())


def diagnose_job(job, ticks: list[dict] | None = None, samples: int = MAX_SAMPLES) -> Diagnosis:
    """Evidence from stored data -> the classifier (pure)."""
    ticks = job_ticks(job, samples) if ticks is None else ticks
    stats = rollout_stats(job)
    sweep = latest_sweep(job)
    ev = build_evidence(ticks, config=job_config(job), rollout_stats=stats,
                        sweep=sweep.as_result_dict() if sweep else None)
    ev.profile_top = profile_top(job)  # the profiling app's answer, once a snapshot exists
    return diagnose(ev)


def adaptive_decisions(job, ticks: list[dict] | None = None, limit: int = 200) -> list[dict]:
    """The adaptive controller's decisions for a job, oldest first, from the metric samples."""
    out: list[dict] = []
    for row in (job_ticks(job) if ticks is None else ticks):
        ad = (row.get("extra") or {}).get("adaptive") or {}
        for d in ad.get("new_decisions") or []:
            out.append(dict(d, worker=row.get("worker") or ""))
    return out[-limit:]


def diagnosis_payload(job, samples: int = MAX_SAMPLES, cache_s: float = 0.0) -> dict:
    """What the API and the panel show: the diagnosis, adaptive decisions and the latest sweep.
    With cache_s, a payload computed in the last cache_s seconds for the same job state and counts is reused
    (the job page re-fetches its panels every few seconds)."""
    if cache_s > 0:
        key = f"diagnostics:payload:{job.pk}:{job.state}:{job.completed_count}:{job.failed_count}:{samples}"
        hit = cache.get(key)
        if hit is not None:
            return hit
        payload = diagnosis_payload(job, samples)
        cache.set(key, payload, cache_s)
        return payload
    ticks = job_ticks(job, samples)
    d = diagnose_job(job, ticks)
    sweep = latest_sweep(job)
    return {
        "job": job.pk,
        "state": job.state,
        "computed_at": timezone.now().isoformat(),
        "diagnosis": d.to_dict(),
        "parallelism_auto": bool(getattr(job, "parallelism_auto", False)),
        "adaptive_decisions": adaptive_decisions(job, ticks),
        "sweep": sweep_payload(sweep) if sweep else None,
    }


# ------------------------------------------------------------------------------------------ sweeps
def sweep_errors(*, sample_size, start_parallelism, max_parallelism, levels) -> dict[str, str]:
    """The operator's bounds on a sweep: the job caps (JOBS_MAX_PARALLELISM for every level it runs)."""
    errors = {}
    if sample_size < 1 or max_parallelism < 1 or start_parallelism < 1:
        errors["detail"] = "sample_size, start_parallelism and max_parallelism must be >= 1"
    cap = settings.JOBS_MAX_PARALLELISM
    if max(max_parallelism, start_parallelism, *(levels or [0])) > cap:
        errors["max_parallelism"] = f"a sweep runs at most {cap} requests at once (JOBS_MAX_PARALLELISM)"
    return errors


def create_sweep(*, endpoint, dataset=None, job=None, owner=None, sample_size=64, levels=None, start_parallelism=1,
                 max_parallelism=512, verifier=None, verifier_options=None, verify_mode=None,
                 responses_create_params=None) -> ParallelismSweep:
    """Store a queued sweep. Under the same caps and per-user quotas as jobs (it counts as an active job with
    its peak parallelism, checked under the lock on the user's row): ValidationError otherwise; ValueError
    without a dataset."""
    if job is not None:
        dataset = dataset or job.dataset
        verifier = verifier or job.verifier
        verifier_options = verifier_options if verifier_options is not None else job.verifier_options
        verify_mode = verify_mode or job.verify_mode
        responses_create_params = responses_create_params if responses_create_params is not None else job.responses_create_params
    if dataset is None:
        raise ValueError("a sweep needs a dataset (or a job to take it from)")
    if errors := sweep_errors(sample_size=sample_size, start_parallelism=start_parallelism,
                              max_parallelism=max_parallelism, levels=levels):
        raise ValidationError(errors)
    # the same checks as a job's: URLs through the gate, secrets the owner may use (a job's own verifier was
    # checked when it was created, an operator's dotted path included)
    check_verifier(verifier or "math", verifier_options or {}, owner,
                   operator=job is not None and (verifier or "math") == job.verifier)
    sweep = ParallelismSweep(
        owner=owner, endpoint=endpoint, dataset=dataset, job=job, sample_size=sample_size,
        levels=list(levels or []), start_parallelism=start_parallelism, max_parallelism=max_parallelism,
        verifier=verifier or "math", verifier_options=verifier_options or {}, verify_mode=verify_mode or "inline",
        responses_create_params=responses_create_params or {})
    with transaction.atomic():
        limits.lock_owner(owner)
        if quota := limits.quota_errors(owner, sweep.peak_parallelism):
            raise ValidationError({("max_parallelism" if k == "num_samples_in_parallel" else k): v
                                   for k, v in quota.items()})
        sweep.save()
    return sweep


def cancel_sweep(sweep: ParallelismSweep) -> bool:
    """Cancel a queued or running sweep: a queued one never starts, a running one stops at its next check
    (about a second; the points so far are kept). False when it had already ended."""
    done = ParallelismSweep.objects.filter(
        pk=sweep.pk, state__in=[ParallelismSweep.State.QUEUED, ParallelismSweep.State.RUNNING]).update(
        state=ParallelismSweep.State.CANCELLED, finished_at=timezone.now(), stopped_reason="cancelled")
    sweep.refresh_from_db()
    return bool(done)


class SweepDeadline(Exception):
    pass


def run_sweep(sweep: ParallelismSweep, deadline_s: float | None = None) -> ParallelismSweep:
    """Run a stored sweep to its end (in this thread), saving each point as it comes; stopped at its total
    deadline (DIAGNOSTICS_SWEEP_DEADLINE_S) and marked failed with that reason."""
    deadline_s = settings.DIAGNOSTICS_SWEEP_DEADLINE_S if deadline_s is None else deadline_s
    claimed = ParallelismSweep.objects.filter(  # atomically: a cancel before the start wins
        pk=sweep.pk, state__in=[ParallelismSweep.State.QUEUED, ParallelismSweep.State.FAILED]).update(
        state=ParallelismSweep.State.RUNNING, started_at=timezone.now(), points=[], error_message="")
    sweep.refresh_from_db()
    if not claimed:
        return sweep
    try:
        rows = [row for _, row in iter_rows(sweep.dataset, 0, sweep.sample_size)]
        spec = CollectionSpec(endpoint=endpoint_spec(sweep.endpoint), parallelism=1,
                              responses_create_params=dict(sweep.responses_create_params or {}),
                              verifier=sweep.verifier,
                              verifier_options=bind_options(sweep.verifier, sweep.verifier_options, sweep.owner),
                              verify_mode=sweep.verify_mode)
        points: list[dict] = []

        def in_thread(fn):
            """Database work from the sweep's event loop: in a thread, closing its connection after."""
            def run():
                try:
                    return fn()
                finally:
                    connection.close()

            return asyncio.to_thread(run)

        def on_point(p):
            points.append(asdict(p))
            snapshot = list(points)
            return in_thread(lambda: ParallelismSweep.objects.filter(pk=sweep.pk).update(points=snapshot))

        def should_stop():
            return in_thread(lambda: ParallelismSweep.objects.filter(
                pk=sweep.pk, state=ParallelismSweep.State.CANCELLED).exists())

        async def bounded():
            try:
                return await asyncio.wait_for(
                    engine_sweep(spec, rows, levels=sweep.levels or None, start=sweep.start_parallelism,
                                 max_parallelism=sweep.max_parallelism, on_point=on_point, should_stop=should_stop),
                    deadline_s)
            except asyncio.TimeoutError:
                raise SweepDeadline(f"stopped at its total deadline of {deadline_s:g} s "
                                    f"(DIAGNOSTICS_SWEEP_DEADLINE_S) with {len(points)} level(s) measured") from None

        result = asyncio.run(bounded())
        sweep.refresh_from_db(fields=["state"])
        final = ParallelismSweep.State.CANCELLED if sweep.state == ParallelismSweep.State.CANCELLED else ParallelismSweep.State.COMPLETED
        sweep.mark(final, points=result.to_dict()["points"], knee=result.knee, recommended=result.recommended,
                   best_rollouts_per_s=result.best_rollouts_per_s, speedup=result.speedup, hint=result.hint,
                   interpretation=result.interpretation, stopped_reason=result.stopped_reason[:300])
    except SweepDeadline as exc:
        logger.warning("sweep %s: %s", sweep.pk, exc)
        sweep.mark(ParallelismSweep.State.FAILED, error_message=str(exc), stopped_reason="deadline")
    except Exception as exc:
        logger.exception("sweep %s failed", sweep.pk)
        sweep.mark(ParallelismSweep.State.FAILED, error_message=f"{type(exc).__name__}: {exc}"[:5000])
    return sweep


def sweep_payload(sweep: ParallelismSweep) -> dict:
    return {
        "id": sweep.pk, "state": sweep.state, "endpoint": sweep.endpoint_id, "dataset": sweep.dataset_id,
        "job": sweep.job_id, "sample_size": sweep.sample_size, "points": sweep.points, "knee": sweep.knee,
        "recommended": sweep.recommended, "best_rollouts_per_s": sweep.best_rollouts_per_s, "speedup": sweep.speedup,
        "hint": sweep.hint, "interpretation": sweep.interpretation, "stopped_reason": sweep.stopped_reason,
        "error": sweep.error_message, "created_at": sweep.created_at.isoformat() if sweep.created_at else None,
        "finished_at": sweep.finished_at.isoformat() if sweep.finished_at else None,
    }


def active_sweeps_work(owner) -> tuple[int, int]:
    """(how many, total parallelism) of the user's queued and running sweeps, for the quotas (limits.py):
    a sweep's parallelism is the most it runs at once."""
    sweeps = ParallelismSweep.objects.filter(owner=owner, state__in=[ParallelismSweep.State.QUEUED,
                                                                     ParallelismSweep.State.RUNNING])
    return sweeps.count(), sum(s.peak_parallelism for s in sweeps.only("max_parallelism", "levels"))
