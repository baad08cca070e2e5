"""The exports app's notice listener (controlplane.notices), apart from its Celery tasks: Django's set-up registers
it without importing Celery; the task module is imported when an export is queued."""
from __future__ import annotations

import logging

from . import mlflow_export, tracing

log = logging.getLogger(__name__)

ENDS = ("job.completed", "job.failed")


def wanted(info: dict) -> bool:
    return tracing.enabled() or mlflow_export.job_wants(info.get("job_id"))


def on_notice(kind: str, info: dict) -> None:
    """A job ended (controlplane.notices): queue its exports when it has any. Quick: at most one query and a
    queue message; nothing here calls out."""
    if kind in ENDS and info.get("job_id") and wanted(info):
        from .tasks import export_job_task

        try:
            export_job_task.delay(info["job_id"])
        except Exception:  # noqa: BLE001 - no broker: logged, never raised into the job
            log.exception("job %s: could not queue its exports", info["job_id"])
