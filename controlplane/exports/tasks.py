"""Exports of a job, off the request path: the OpenTelemetry job span and the MLflow run (live while it runs)."""
from __future__ import annotations

import logging

from celery import shared_task

from controlplane.jobs.models import CollectionJob

from . import mlflow_export, tracing

log = logging.getLogger(__name__)


@shared_task(name="controlplane.exports.tasks.export_job_task", ignore_result=True)
def export_job_task(job_id: int) -> dict:
    job = CollectionJob.objects.select_related("endpoint", "dataset").filter(pk=job_id).first()
    if job is None:
        return {"job": job_id, "gone": True}
    out = {"job": job_id, "job_span": False, "mlflow_run_id": None}
    try:
        out["job_span"] = tracing.export_job_span(job)
    except Exception:  # noqa: BLE001 - a tracker being down never fails anything else
        log.exception("job %s: exporting the job span failed", job_id)
    try:
        out["mlflow_run_id"] = mlflow_export.export_job(job)
    except Exception:  # noqa: BLE001
        log.exception("job %s: MLflow export failed", job_id)
    return out


@shared_task(name="controlplane.exports.tasks.mlflow_live_task", ignore_result=True)
def mlflow_live_task() -> int:
    """Beat (control lane): one query, then a tick per live job on the work queue, where the calls to the tracking
    server go (a slow tracker never holds a control slot). A tick queued twice writes nothing twice (the cursor)."""
    ids = list(mlflow_export.live_jobs().values_list("pk", flat=True))
    for job_id in ids:
        mlflow_live_job_task.delay(job_id)
    return len(ids)


@shared_task(name="controlplane.exports.tasks.mlflow_live_job_task", ignore_result=True)
def mlflow_live_job_task(job_id: int) -> int:
    job = CollectionJob.objects.select_related("endpoint", "dataset").filter(pk=job_id).first()
    return mlflow_export.live_tick_job(job) if job is not None else 0
