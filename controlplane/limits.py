"""Operator limits, checked in one place for every way in (dashboard forms, the API, the admin, the CLI
and management commands all reach these through Endpoint.clean(), the endpoint serializer, and the
jobs service's validation).

- Endpoint bounds: timeouts and retries between a floor and a ceiling from settings.
- Model-server URLs: ENDPOINT_ALLOWED_HOSTS (["*"] on a laptop; a list in production) and, always,
  no link-local or cloud-metadata address, checked on the URL as written and on what its host
  resolves to (checked again right before every health probe and pre-warm: DNS can change).
- Job bounds (parallelism, repeats, chunk size, limit) and per-user quotas (running jobs, total
  parallelism of running jobs).
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import Sum

from controlplane.jobs.models import CollectionJob, JobState

# Cloud metadata services (AWS/GCP/Azure/OpenStack: 169.254.169.254, link-local anyway; AWS IPv6,
# Alibaba, Oracle) and the names they answer to.
METADATA_ADDRESSES = {ipaddress.ip_address(a) for a in
                      ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "192.0.0.192")}
METADATA_NAMES = {"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                  "instance-data.ec2.internal"}


def _forbidden_ip(ip) -> str | None:
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved:
        return "not a unicast address"
    return None


def _host_allowed(host: str) -> bool:
    for pattern in settings.ENDPOINT_ALLOWED_HOSTS:
        pattern = pattern.lower().strip()
        if pattern == "*" or host == pattern or (pattern.startswith(".") and
                                                  (host.endswith(pattern) or host == pattern[1:])):
            return True
    return False


def url_problem(url: str, *, resolve: bool = True) -> str | None:
    """Why a model server may not be called at this URL, or None."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "not a valid URL"
    if parts.scheme not in ("http", "https") or not host:
        return "must be an http(s) URL with a host"
    if host in METADATA_NAMES:
        return f"{host} is a cloud metadata service"
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None and (why := _forbidden_ip(literal)):
        return f"{host} is {why}"
    if not _host_allowed(host):
        return f"{host} is not an allowed model-server host (ENDPOINT_ALLOWED_HOSTS)"
    if resolve and literal is None:
        try:
            infos = socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            return None  # not resolvable (yet): the probe reports it; nothing is reached
        for info in infos:
            try:
                ip = ipaddress.ip_address(info[4][0].split("%")[0])
            except ValueError:
                continue
            if why := _forbidden_ip(ip):
                return f"{host} resolves to {ip}, {why}"
    return None


def endpoint_errors(values: dict) -> dict[str, list[str]]:
    """Field errors for an endpoint's values (any subset of the fields)."""
    errors: dict[str, list[str]] = {}
    bounds = {
        "request_timeout_s": (0.1, settings.ENDPOINT_MAX_REQUEST_TIMEOUT_S),
        "connect_timeout_s": (0.1, settings.ENDPOINT_MAX_CONNECT_TIMEOUT_S),
        "max_retries": (0, settings.ENDPOINT_MAX_RETRIES),
    }
    for name, (lo, hi) in bounds.items():
        value = values.get(name)
        if value is None:
            continue
        if not (lo <= value <= hi):  # NaN fails too
            errors[name] = [f"must be between {lo:g} and {hi:g}"]
    urls = [("base_url", values.get("base_url"))] + [("replica_urls", u) for u in values.get("replica_urls") or []]
    for field, url in urls:
        if url and (why := url_problem(str(url))):
            errors.setdefault(field, []).append(f"{url}: {why}")
    return errors


def check_endpoint_urls(endpoint) -> None:
    """Right before calling an endpoint's servers: raise ValidationError if any URL is not allowed now."""
    problems = [f"{u}: {why}" for u in endpoint.all_base_urls if (why := url_problem(u))]
    if problems:
        raise ValidationError("; ".join(problems))


def job_errors(*, limit, num_repeats, num_samples_in_parallel, chunk_size) -> dict[str, str]:
    errors = {}
    caps = {"num_samples_in_parallel": (num_samples_in_parallel, settings.JOBS_MAX_PARALLELISM),
            "num_repeats": (num_repeats, settings.JOBS_MAX_NUM_REPEATS),
            "chunk_size": (chunk_size, settings.JOBS_MAX_CHUNK_SIZE),
            "limit": (limit, 2**31 - 1)}
    for name, (value, cap) in caps.items():
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            errors[name] = f"{name} must be at most {cap}, not {value}"
    return errors


def quota_errors(owner, num_samples_in_parallel) -> dict[str, str]:
    """Per-user quotas over the user's queued and running jobs (paused ones hold no workers)."""
    if owner is None or getattr(owner, "pk", None) is None:
        return {}
    active = CollectionJob.objects.filter(owner=owner, state__in=[JobState.QUEUED, JobState.RUNNING])
    n = active.count()
    if n >= settings.JOBS_MAX_ACTIVE_PER_USER:
        return {"__all__": f"you already have {n} queued or running jobs (at most "
                           f"{settings.JOBS_MAX_ACTIVE_PER_USER}); wait for one to finish or cancel one"}
    used = active.aggregate(p=Sum("num_samples_in_parallel"))["p"] or 0
    if isinstance(num_samples_in_parallel, int) and used + num_samples_in_parallel > settings.JOBS_MAX_PARALLELISM_PER_USER:
        return {"num_samples_in_parallel": f"your queued and running jobs use {used} of your "
                                           f"{settings.JOBS_MAX_PARALLELISM_PER_USER} parallel requests; "
                                           f"{num_samples_in_parallel} more is over that"}
    return {}
