"""Operator limits, checked in one place for every way in (dashboard forms, the API, the admin, the CLI
and management commands all reach these through Endpoint.clean(), the endpoint serializer, and the
jobs service's validation).

- Endpoint bounds: timeouts and retries between a floor and a ceiling from settings.
- URLs users give (model servers, replicas, judges, remote verifiers, /stats): the outbound gate's check
  (workers.outbound.url_problem with the settings' policy, controlplane/outbound.py), on the URL as written and
  on what its host resolves to. The gate checks again on every call (DNS can change).
- Job bounds (parallelism, repeats, chunk size, limit) and per-user quotas (running jobs, total
  parallelism of running jobs).
"""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model

from controlplane.outbound import policy
from workers import outbound


def url_problem(url: str, *, resolve: bool = True) -> str | None:
    """Why the product may not call this URL, or None."""
    return outbound.url_problem(url, policy(), resolve=resolve)


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


def lock_owner(owner) -> None:
    """Inside a transaction: lock the user's row (SELECT ... FOR UPDATE), so one user's quota checks and the
    creations they allow run one at a time, on every web process (SQLite serializes writes anyway)."""
    if owner is not None and getattr(owner, "pk", None) is not None:
        get_user_model().objects.select_for_update().filter(pk=owner.pk).values_list("pk", flat=True).first()


# What holds workers, per app: `counter(owner) -> (how many, total parallelism)` of the user's queued and
# running work, registered from the apps' ready() (jobs: collection jobs; diagnostics: parallelism sweeps).
WORK_COUNTERS: dict[str, object] = {}


def register_work_counter(name: str, counter) -> None:
    WORK_COUNTERS[name] = counter


def active_work(owner) -> tuple[int, int]:
    """(how many, total parallelism) of the user's queued and running work over every registered kind.
    Paused jobs hold no workers."""
    n = used = 0
    for counter in WORK_COUNTERS.values():
        k, p = counter(owner)
        n, used = n + k, used + p
    return n, used


def quota_errors(owner, num_samples_in_parallel) -> dict[str, str]:
    """Per-user quotas over the user's queued and running jobs and sweeps. Call it in the transaction that
    creates the job or sweep, after lock_owner(owner): checked unlocked, concurrent requests all pass."""
    if owner is None or getattr(owner, "pk", None) is None:
        return {}
    n, used = active_work(owner)
    if n >= settings.JOBS_MAX_ACTIVE_PER_USER:
        return {"__all__": f"you already have {n} queued or running jobs and sweeps (at most "
                           f"{settings.JOBS_MAX_ACTIVE_PER_USER}); wait for one to finish or cancel one"}
    if isinstance(num_samples_in_parallel, int) and used + num_samples_in_parallel > settings.JOBS_MAX_PARALLELISM_PER_USER:
        return {"num_samples_in_parallel": f"your queued and running jobs and sweeps use {used} of your "
                                           f"{settings.JOBS_MAX_PARALLELISM_PER_USER} parallel requests; "
                                           f"{num_samples_in_parallel} more is over that"}
    return {}


# The rollout stream (controlplane.jobs.stream): a batch holds at most this many rollouts (`?max=`), and in rows
# mode ends before the row that would take its rows' JSON past this many bytes (at least one row), so that a
# large `max` on large rollouts stays within a bounded response.
STREAM_MAX_BATCH = 50_000
STREAM_MAX_BATCH_BYTES = 64 << 20
