"""Where a job's verification cache lives (collection chunks and verification runs alike): Redis at
VERIFY_CACHE_URL, scoped to the job (or "global"); see workers.verifiers.shared_cache."""
from __future__ import annotations

from django.conf import settings


def verify_cache_scope(job) -> str:
    """The shared cache's scope: the job (its id and creation time: ids of a rebuilt database never meet old
    entries) or every job ("global")."""
    if job.verify_cache == "global":
        return "global"
    return f"job:{job.pk}:{int(job.created_at.timestamp())}"


def verify_cache_spec(job) -> dict:
    """Where the verification cache lives for this job's runs (collection chunks and verification runs)."""
    url = settings.VERIFY_CACHE_URL if job.verify_cache != "off" else ""
    return {"verify_cache_url": url or None, "verify_cache_scope": verify_cache_scope(job) if url else "",
            "verify_cache_ttl_s": settings.VERIFY_CACHE_TTL_S, "verify_cache_claim_s": settings.VERIFY_CACHE_CLAIM_S,
            "verify_cache_shared_choice": settings.VERIFY_CACHE_SHARED}
