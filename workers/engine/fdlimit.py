"""The open-file limit: every request in flight holds a socket, so 16k in flight needs ~16.5k descriptors.

raise_open_file_limit() lifts the soft RLIMIT_NOFILE to the hard limit (what an unprivileged process may
do); the hard limit itself is the operator's: `ulimit -Hn`, systemd's LimitNOFILE=, docker's
`--ulimit nofile=N:N` / compose `ulimits:`. Called when a Celery worker starts and when the engine starts
a run; the engine warns when the limit stays below what the run's parallelism needs.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

try:
    import resource
except ImportError:  # not on POSIX: nothing to raise
    resource = None

# Descriptors a run needs beyond one socket per request: the database, Redis, the verifier pool's pipes,
# log files, the interpreter's own.
FD_HEADROOM = 256
_CAP_WHEN_UNLIMITED = 1 << 20  # Linux refuses RLIM_INFINITY for NOFILE (fs.nr_open caps it)


def open_file_limit() -> tuple[int, int] | None:
    """(soft, hard), or None where the platform has no rlimits."""
    if resource is None:
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_open_file_limit() -> tuple[int, int] | None:
    """Raise the soft open-file limit to the hard limit; returns (soft, hard) after. Never raises."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _CAP_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %s to %s: %s", soft, target, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def check_open_file_limit(parallelism: int) -> str | None:
    """Raise the limit, then a warning (also logged) when `parallelism` sockets + headroom do not fit."""
    limits = raise_open_file_limit()
    if limits is None:
        return None
    soft, hard = limits
    need = int(parallelism) + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        msg = (f"open-file limit {soft} (hard {hard}) is below the {need} this run needs for {parallelism} "
               f"requests in flight: requests beyond it fail with 'Too many open files'; raise the hard limit "
               f"(ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=N:N)")
        log.warning(msg)
        return msg
    return None
