"""The profiling panel of the job page (its table refreshes itself from the API, see static/profiling)."""
from __future__ import annotations

from . import services


def panel_context(request, job) -> dict:
    try:
        prof = services.job_profile(job)
    except Exception as exc:  # noqa: BLE001  (the job page renders without this panel's data)
        return {"error": f"{type(exc).__name__}: {exc}"}
    prof["rows"] = prof["rows"][:40]
    return {"profile": prof, "runnable": job.state in ("queued", "running", "paused")}
