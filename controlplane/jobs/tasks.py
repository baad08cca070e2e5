"""Celery entry points: thin, idempotent, taking ids. The logic is in runtime.py and services.py.

Run workers with the threads pool (the engine runs in the task's thread under asyncio.run; prefork
children are daemonic and cannot start the engine's verification process pool):

    celery -A controlplane worker -P threads -c 4 -l info
    celery -A controlplane beat -l info     # tasks.watchdog every JOBS_WATCHDOG_INTERVAL_S (10 s)
"""
from __future__ import annotations

from celery import shared_task

from controlplane.endpoints.ops import recover_lost_actions

from . import capacity, resume, runtime, services, verification  # noqa: F401 (resume: the worker's resume slots)
from .models import CollectionJob, JobChunk


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_chunk_task(chunk_id: int) -> str:
    """Run one chunk. Idempotent: a duplicate or redelivered message finds the chunk leased or done. An owner at
    their fair share of the workers while others wait gets the message back later (capacity.py)."""
    if capacity.HANDING_BACK.is_set():  # this worker is stopping: the message goes back for another one
        chunk = JobChunk.objects.filter(pk=chunk_id).select_related("job", "job__endpoint").first()
        if chunk is not None:
            services.send_task(services.RUN_CHUNK_TASK, chunk_id, queue=capacity.queue_of(chunk.job))
        return "handed_back"
    if capacity.requeued_over_share(chunk_id):
        return "requeued"
    return runtime.run_chunk(chunk_id, runtime.default_worker_name("celery"))


@shared_task(ignore_result=True)
def watchdog() -> dict:
    """Reclaim chunks of dead workers, re-send lost chunks, flag stalled jobs, finalize stragglers."""
    broker_lost = services.broker_lost_its_data()  # once: only one caller sees a given loss
    report = runtime.watchdog(broker_lost=broker_lost)
    report["verification_reclaimed"] = verification.reclaim_stale(broker_lost=broker_lost)
    if broker_lost:
        report["ops_actions"] = recover_lost_actions()
    report["broker_lost"] = broker_lost
    return report


@shared_task(acks_late=True, ignore_result=True)
def finalize_job_task(job_id: int) -> str:
    job = CollectionJob.objects.filter(pk=job_id).first()
    if job is None:
        return "missing"
    return services.finalize_job(job).state


@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def verify_job_task(run_id: int) -> str:
    """Verify a job's stored rollouts (resumable; a duplicate message finds the run leased or done)."""
    return verification.run_verification(run_id, runtime.default_worker_name("celery-verify"))
