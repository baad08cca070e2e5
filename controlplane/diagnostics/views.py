"""The job page's diagnosis panel: context for templates/diagnostics/panel.html."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PANEL_CACHE_S = 5.0


def panel_context(request, job) -> dict:
    """{diag, decisions, sweep} for the panel; an error here never breaks the job page."""
    from . import services

    try:
        payload = services.diagnosis_payload(job, cache_s=PANEL_CACHE_S)
    except Exception as e:  # pragma: no cover - defensive
        logger.exception("diagnosis of job %s failed", job.pk)
        return {"error": f"{type(e).__name__}: {e}"}
    d = payload["diagnosis"]
    return {
        "diag": d,
        "supporting": [i for i in d["evidence_items"] if i.get("holds")],
        "context_items": [i for i in d["evidence_items"] if not i.get("supports")],
        "decisions": payload["adaptive_decisions"][-20:],
        "parallelism_auto": payload["parallelism_auto"],
        "sweep": payload["sweep"],
    }
