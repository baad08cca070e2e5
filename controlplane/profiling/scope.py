"""Which NeMo Gym servers a job's profiling may call: the servers of its own deployment (its endpoint and, for NeMo
Gym, every server its head server lists) or hosts the operator's ENDPOINT_ALLOWED_HOSTS names. Used by stats_urls,
profile_servers and collect_rollouts' +profiling_enabled; every call also goes through workers.outbound's gate."""
from __future__ import annotations

from django.conf import settings


def _hostport(url: str) -> str | None:
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    return f"{(u.hostname or '').lower().rstrip('.')}:{port}" if u.hostname else None


def deployment_servers(job) -> set[str]:
    """host:port of every server of the job's own deployment: its endpoint's base URLs and, for a NeMo Gym
    deployment, each server its head server lists (resolved now; the head unreachable: the endpoint's only)."""
    endpoint = job.endpoint
    found = {hp for u in endpoint.all_base_urls if (hp := _hostport(u))}
    if endpoint.is_nemo_gym:
        from workers.nemo_gym.deployment import DeploymentError, resolve_sync

        try:
            dep = resolve_sync(endpoint.base_url, timeout_s=5.0)
            found |= {hp for srv in dep.servers.values() if (hp := _hostport(srv.url))}
        except (DeploymentError, ValueError):
            pass
    return found


def _allow_listed(url: str) -> bool:
    """Named by an entry of ENDPOINT_ALLOWED_HOSTS other than "*" (the operator's own list of servers)."""
    from workers import outbound

    entries = [e for e in settings.ENDPOINT_ALLOWED_HOSTS if e.strip() and e.strip() != "*"]
    if not entries:
        return False
    return outbound.url_problem(url, outbound.OutboundPolicy(allow=tuple(entries))) is None


def stats_url_problem(url: str, allowed: set[str]) -> str | None:
    """Why a stats URL may not be pulled for this job, or None: it must be a /stats of a server of the job's own
    deployment (`allowed`, deployment_servers) or of a host the operator's allow-list names."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
    except ValueError:
        return "not a valid URL"
    if u.path.rstrip("/") != "/stats" or u.query or u.fragment:
        return "must be a NeMo Gym server's /stats (http://host:port/stats)"
    if _hostport(url) not in allowed and not _allow_listed(url):
        return ("not a server of this job's deployment (its endpoint and, for NeMo Gym, the servers its head server "
                "lists) nor named in ENDPOINT_ALLOWED_HOSTS")
    return None
