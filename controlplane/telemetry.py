"""The control plane's own Prometheus metrics: the events, recorded where they happen (core: any app
records here; the monitoring app serves the scrape).

Two kinds, so every figure is right with several web and worker processes on several hosts:
* events (rollouts stored by outcome, failures by class, chunk lease lag, chunk run outcomes, write-batch
  latency) are counters / histograms recorded where they happen, in prometheus-client's multi-process
  mode: each process writes its own mmap file under settings.PROMETHEUS_MULTIPROC_DIR and a scrape sums
  every file there (processes that exited included, so counters never go back). The directory is emptied
  when a deployment starts (scripts/demo.sh, the compose `migrate` service), never by a running process.
* states (jobs by state, chunks, stale leases, live workers) are read from the database at scrape time
  (DatabaseCollector): the same answer whichever web process is scraped.
"""
from __future__ import annotations

import logging
import os
import socket

from django.conf import settings
from prometheus_client import Counter, Histogram, values

logger = logging.getLogger(__name__)

MULTIPROC_DIR = str(settings.PROMETHEUS_MULTIPROC_DIR)
os.makedirs(MULTIPROC_DIR, exist_ok=True)
# prometheus-client reads the directory from the environment when a value is created; processes this one
# starts (verifier pools) inherit it.
os.environ["PROMETHEUS_MULTIPROC_DIR"] = MULTIPROC_DIR


def _process_identifier() -> str:
    """Unique among processes sharing the directory: containers of one compose project may share a volume
    and each has its own pid 1, so the host name goes in too ('_' separates fields in the file name)."""
    return f"{socket.gethostname().replace('_', '-')}-{os.getpid()}"


# Always ours (with the host name), even when prometheus-client chose os.getpid from the environment at import.
values.ValueClass = values.MultiProcessValue(process_identifier=_process_identifier)

# Not registered in the default registry: a scrape builds its own from the files (multi-process rule).
_NO_REGISTRY = None

ROLLOUTS = Counter("controlplane_rollouts", "Rollouts stored (each (job, task, repeat) once: duplicates from a "
                   "re-run chunk are not counted), by outcome; rate() gives rollouts/s",
                   ["outcome"], registry=_NO_REGISTRY)
ROLLOUT_FAILURES = Counter("controlplane_rollout_failures", "Failed rollouts stored, by failure class "
                           "(http_429, http_5xx, timeout, connection, verifier_error, ...)",
                           ["failure_class"], registry=_NO_REGISTRY)
CHUNK_RUNS = Counter("controlplane_chunk_runs", "Chunk runs ended, by outcome (done, failed, paused, cancelled, "
                     "lost_lease, incomplete; busy: another worker held it, e.g. a duplicate message or the CLI "
                     "waiting; skipped: already done or the job not runnable)", ["outcome"], registry=_NO_REGISTRY)
CHUNK_LEASE_LAG = Histogram("controlplane_chunk_lease_lag_seconds", "Time from a chunk's dispatch to a worker "
                            "taking its lease", buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
                            registry=_NO_REGISTRY)
WRITE_BATCH_SECONDS = Histogram("controlplane_write_batch_seconds", "Latency of one batched database write "
                                "(rollout insert + job counters + heartbeat; verification reward updates)",
                                ["kind"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                registry=_NO_REGISTRY)
WRITE_BATCH_ROWS = Counter("controlplane_write_batch_rows", "Rows handed to batched database writes", ["kind"],
                           registry=_NO_REGISTRY)


# Named controlplane_admin_action_seconds until ops were renamed (issue: one name per concept).
OPS_ACTION_SECONDS = Histogram("controlplane_ops_action_seconds", "What a caller of an ops action (weight "
                               "update, pause...) waits: phase=dispatch (asked -> a worker started it), phase=total "
                               "(asked -> finished)", ["kind", "phase"],
                               buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
                               registry=_NO_REGISTRY)


def record_ops_action(kind: str, dispatch_ms: float | None, total_ms: float | None) -> None:
    if dispatch_ms is not None:
        OPS_ACTION_SECONDS.labels(kind, "dispatch").observe(dispatch_ms / 1000.0)
    if total_ms is not None:
        OPS_ACTION_SECONDS.labels(kind, "total").observe(total_ms / 1000.0)


def record_rollout_batch(seconds: float, rows: int, ok: int, failed_by_class: dict[str, int]) -> None:
    """After a committed batch of rollouts: what was really inserted, and how long the write took."""
    WRITE_BATCH_SECONDS.labels("rollouts").observe(seconds)
    WRITE_BATCH_ROWS.labels("rollouts").inc(rows)
    if ok:
        ROLLOUTS.labels("ok").inc(ok)
    failed = sum(failed_by_class.values())
    if failed:
        ROLLOUTS.labels("failed").inc(failed)
    for failure_class, n in failed_by_class.items():
        ROLLOUT_FAILURES.labels(failure_class or "unknown").inc(n)


def record_verify_batch(seconds: float, rows: int) -> None:
    WRITE_BATCH_SECONDS.labels("verify").observe(seconds)
    WRITE_BATCH_ROWS.labels("verify").inc(rows)


def record_lease_taken(dispatched_at, taken_at) -> None:
    """A worker took a chunk's lease; dispatched_at is None for chunks the CLI runs in its own process."""
    if dispatched_at is not None:
        CHUNK_LEASE_LAG.observe(max(0.0, (taken_at - dispatched_at).total_seconds()))


def record_chunk_run(outcome: str) -> None:
    CHUNK_RUNS.labels(outcome).inc()


# Collectors other apps add from their ready() (the dashboard: live workers from its heartbeats); a scrape
# registers each beside the database gauges, when its look at the database found it answering (they read it).
SCRAPE_COLLECTORS: list = []


def register_scrape_collector(collector) -> None:
    if not any(type(c) is type(collector) for c in SCRAPE_COLLECTORS):
        SCRAPE_COLLECTORS.append(collector)
