"""The profiling panel of the job page (its table refreshes itself from the API, see static/profiling)."""
from __future__ import annotations

from controlplane import operator as knobs

from . import comparison, services


COMPARE_TOP = 25  # functions listed per pair on the compare page (the API has them all)


def compare_context(request, jobs) -> dict | None:
    """The compare page's profiling section: the first job against each other one, per function; left out
    when none of the jobs was profiled."""
    try:
        pairs = []
        first = comparison.job_figures(jobs[0])  # merged once, set against each other job
        for other in jobs[1:]:
            cmp = comparison.compare_jobs(jobs[0], other, a=first)
            cmp["shown"] = cmp["functions"][:COMPARE_TOP]
            cmp["a_job"], cmp["b_job"] = jobs[0], other
            pairs.append(cmp)
    except Exception as exc:  # noqa: BLE001  (the compare page renders without this section's data)
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not any(p["functions"] for p in pairs):
        return None
    return {"pairs": pairs, "top": COMPARE_TOP}


def panel_context(request, job) -> dict:
    try:
        prof = services.job_profile(job)
    except Exception as exc:  # noqa: BLE001  (the job page renders without this panel's data)
        return {"error": f"{type(exc).__name__}: {exc}"}
    prof["rows"] = prof["rows"][:40]
    return {"profile": prof, "runnable": job.state in ("queued", "running", "paused"),
            "worker_scope": knobs.may_profile_worker(getattr(request, "user", None))}
