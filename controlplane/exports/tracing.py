"""The job's own OpenTelemetry span (its chunks' spans name it as parent: workers.tracing.job_span_ids)."""
from __future__ import annotations

from django.conf import settings

from controlplane.jobs.runtime import job_trace_key
from workers.tracing import TraceConfig
from workers.tracing import export_job_span as _export


def enabled() -> bool:
    return getattr(settings, "TRACING_MODE", "off") == "otlp" and bool(getattr(settings, "TRACING_OTLP_ENDPOINT", ""))


def export_job_span(job) -> bool:
    """Send the span of a finished job (started_at .. finished_at) to the deployment's OTLP endpoint."""
    if not enabled() or job.started_at is None:
        return False
    config = TraceConfig(mode="otlp", endpoint=settings.TRACING_OTLP_ENDPOINT, service_name=settings.TRACING_SERVICE_NAME,
                         job_key=job_trace_key(job))
    end = job.finished_at or job.started_at
    return _export(config, int(job.started_at.timestamp() * 1e9), int(end.timestamp() * 1e9),
                   {"job.id": job.pk, "job.name": job.name, "job.state": str(job.state), "endpoint.id": job.endpoint_id,
                    "job.completed": job.completed_count, "job.failed": job.failed_count},
                   error=job.error_message if str(job.state) == "failed" else "")
