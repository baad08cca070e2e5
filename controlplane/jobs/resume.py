"""Resume slots: a dead or stopping worker's chunk goes on at once, whatever the other workers are doing.

The watchdog (on the control lane, controlplane/lanes.py) reclaims a chunk whose holder stopped heartbeating
within JOBS_LEASE_TIMEOUT_S plus one watchdog interval, and sends its message again; but on a busy queue that
message waits until some chunk ends, which can be as long as a chunk runs. So each worker process that takes
chunks keeps JOBS_RESUME_SLOTS threads of its own, beside its Celery slots, that take only such chunks: pending,
of a runnable job, routed to a queue this worker consumes, and last held by a worker that died (the watchdog kept
its name) or handed it back on SIGTERM. They look every RESUME_POLL_S; the lease decides between them and the
chunk's message, so a chunk is run once.
"""
from __future__ import annotations

import logging
import threading

from celery.signals import worker_ready, worker_shutdown
from django.conf import settings
from django.db import close_old_connections

from . import capacity, runtime
from .models import JobChunk, JobState

logger = logging.getLogger(__name__)

RESUME_POLL_S = 0.5
_threads: list[threading.Thread] = []
_stop = threading.Event()


def next_resumable(queues) -> int | None:
    """The oldest chunk a resume slot may take on `queues`, or None."""
    rows = (JobChunk.objects.filter(state=JobChunk.State.PENDING, job__state__in=JobState.RUNNABLE,
                                    heartbeat_at__isnull=False).exclude(lease_owner="")
            .select_related("job__endpoint").order_by("heartbeat_at", "pk")[:50])
    for chunk in rows:
        if capacity.queue_of(chunk.job) in queues:
            return chunk.pk
    return None


def _loop(queues) -> None:
    name = runtime.default_worker_name("celery-resume")
    while not _stop.wait(RESUME_POLL_S):
        if capacity.HANDING_BACK.is_set():
            return
        try:
            close_old_connections()
            chunk_id = next_resumable(queues)
            if chunk_id is not None:
                logger.info("resume slot: taking chunk %s, left by a worker that died or stopped", chunk_id)
                runtime.run_chunk(chunk_id, name)
        except Exception:  # noqa: BLE001 - the slot lives on; the watchdog's message is the fallback
            logger.exception("resume slot failed")


@worker_ready.connect
def _start(sender=None, **_):
    n = int(getattr(settings, "JOBS_RESUME_SLOTS", 1) or 0)
    try:
        queues = {q.name for q in sender.task_consumer.queues}
    except Exception:  # noqa: BLE001
        return
    queues.discard((getattr(settings, "CELERY_CONTROL_QUEUE", "") or "").strip())  # the control lane: no chunks
    if n <= 0 or not queues:
        return
    _stop.clear()
    for i in range(n):
        t = threading.Thread(target=_loop, args=(queues,), name=f"resume-slot-{i}", daemon=True)
        t.start()
        _threads.append(t)
    logger.info("%d resume slot(s) for chunks left by dead or stopping workers on %s", n, ", ".join(sorted(queues)))


@worker_shutdown.connect
def _stop_slots(**_):
    """A run in a resume slot hands its chunk back like any other (HANDING_BACK); wait for it to have done so."""
    _stop.set()
    for t in _threads:
        t.join(settings.JOBS_LEASE_TIMEOUT_S)
    _threads.clear()
