"""Fair capacity: a per-user share of the collection slots, and a total deadline for every chunk run.

Share rule: when several users have collection work on a queue, a user's chunks hold at most
ceil(slots / users with work) leases there, slots being the concurrency (-c) of the live workers consuming that
queue; a user may use idle slots beyond the share while nobody else waits, and gives them back when someone does.

How, with any number of worker processes on any number of hosts:
* slots: each worker registers its concurrency per queue it consumes in Redis (keys that expire unless renewed,
  so a dead worker drops out) at start, and renews them from a background thread;
* users with work: owners of runnable jobs with a dispatched, unfinished chunk routed to the queue;
* held leases: running chunks held by Celery workers whose heartbeat is fresh (the database is the truth).
The chunk task asks `requeued_over_share` once before it runs a chunk: an owner at or over the share while another
user waits gets the message back on the queue with a countdown (JOBS_FAIR_SHARE_RETRY_S). A running chunk is
wrapped by `guard`: every JOBS_FAIR_SHARE_CHECK_S it yields its lease (newest lease first) when its owner holds
more than the share and another user waits, and it stops at its total deadline (JOBS_CHUNK_DEADLINE_S). Either
way the engine cancels its in-flight requests and the runtime hands the chunk back (stored rows are kept, a later
run skips them) or, at a deadline with nothing stored, fails the job with the reason.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane import worker_signals
from workers.engine.types import ControlState

from .models import CHUNK_LEASE, CollectionJob, JobChunk, JobState
from .services import RUN_CHUNK_TASK, chunk_queue

logger = logging.getLogger(__name__)

SLOT_TTL_S = 60.0
SLOT_RENEW_S = 15.0
_SLOTS_CACHE_S = 5.0


# --- the slots: registered by the workers in Redis ------------------------------------------------------
def _redis():
    url = settings.CELERY_BROKER_URL or ""
    if settings.CELERY_TASK_ALWAYS_EAGER or not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis

    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def _slot_key(queue: str) -> str:
    # one registry per control plane (its database): several may share one Redis. A hash per queue, node -> "slots
    # expiry": read with one HGETALL. Not a key per node found with SCAN, which walks the whole keyspace (the
    # verification cache's keys too): 1.1-1.6 s at 1.15M keys, every few chunks a worker started, growing with
    # every rollout verified.
    return f"controlplane:slots:{settings.DATABASES['default']['NAME']}:{queue}"


def register_slots(node: str, queues, concurrency: int, ttl_s: float = SLOT_TTL_S) -> None:
    client = _redis()
    if client is None:
        return
    ttl = max(1, int(ttl_s))
    try:
        with client.pipeline() as pipe:
            for q in queues:
                pipe.hset(_slot_key(q), node, f"{int(concurrency)} {time.time() + ttl:.0f}")
                pipe.expire(_slot_key(q), ttl)  # every worker of the queue gone: the hash goes too
            pipe.execute()
    finally:
        client.close()


def unregister_slots(node: str, queues) -> None:
    client = _redis()
    if client is None:
        return
    try:
        with client.pipeline() as pipe:
            for q in queues:
                pipe.hdel(_slot_key(q), node)
            pipe.execute()
    finally:
        client.close()


_slots_cache: dict[str, tuple[float, int]] = {}


def collection_slots(queue: str) -> int:
    """The concurrency of the live workers consuming `queue` (0 when none registered, or no Redis)."""
    hit = _slots_cache.get(queue)
    if hit and time.monotonic() - hit[0] < _SLOTS_CACHE_S:
        return hit[1]
    total = 0
    client = _redis()
    if client is not None:
        try:
            now = time.time()
            for value in client.hgetall(_slot_key(queue)).values():
                slots, _, expires = value.decode().partition(" ")
                if float(expires or 0) > now:  # a worker that died without unregistering counts until it expires
                    total += int(slots)
        except Exception as exc:  # noqa: BLE001 - no share without the registry, never a failed chunk
            logger.warning("fair share: could not read the worker registry: %s", exc)
        finally:
            client.close()
    _slots_cache[queue] = (time.monotonic(), total)
    return total


_registration: dict = {}


def _register_at_start(sender=None, **_):
    """A worker registers its slots for the queues it consumes, and renews them until it stops."""
    controller = getattr(sender, "controller", None)
    try:
        queues = sorted(q.name for q in sender.task_consumer.queues)
        node, concurrency = controller.hostname, int(controller.concurrency)
    except Exception as exc:  # noqa: BLE001
        logger.warning("fair share: this worker could not register its slots: %s", exc)
        return
    stop = threading.Event()
    _registration.update(node=node, queues=queues, stop=stop)

    def renew():
        while not stop.is_set():
            try:
                register_slots(node, queues, concurrency)
            except Exception as exc:  # noqa: BLE001 - tried again at the next renewal
                logger.warning("fair share: could not renew this worker's slots: %s", exc)
            stop.wait(SLOT_RENEW_S)

    threading.Thread(target=renew, name="fair-share-slots", daemon=True).start()


def _unregister_at_stop(**_):
    if _registration:
        _registration["stop"].set()
        try:
            unregister_slots(_registration["node"], _registration["queues"])
        except Exception:  # noqa: BLE001 - the keys expire anyway
            pass


worker_signals.on("worker_ready", _register_at_start, "capacity-register-slots")
worker_signals.on("worker_shutdown", _unregister_at_stop, "capacity-unregister-slots")


# --- the share ----------------------------------------------------------------------------------------
def queue_of(job) -> str:
    return chunk_queue(job) or settings.CELERY_TASK_DEFAULT_QUEUE


def _work_on(queue: str, *, waiting_only: bool = False) -> set:
    """Owners (None for jobs without one) of runnable jobs with a dispatched unfinished chunk on `queue`;
    with waiting_only, a dispatched chunk no worker holds (pending)."""
    states = [JobChunk.State.PENDING] if waiting_only else [JobChunk.State.PENDING, JobChunk.State.RUNNING]
    rows = (CollectionJob.objects.filter(state__in=JobState.RUNNABLE, chunks__state__in=states,
                                         chunks__dispatched_at__isnull=False)
            .values_list("owner_id", "endpoint__worker_queue", "endpoint__name").distinct())
    default = settings.CELERY_TASK_DEFAULT_QUEUE
    return {owner for owner, own_queue, name in rows
            if (own_queue or settings.JOBS_ENDPOINT_QUEUES.get(name) or default) == queue}


def share(queue: str) -> int | None:
    """Leases one user's chunks may hold on `queue` while others have work there; None: no limit (one user
    with work, or no registered worker)."""
    slots = collection_slots(queue)
    users = _work_on(queue)
    if slots <= 0 or len(users) < 2:
        return None
    return max(1, math.ceil(slots / len(users)))


def held_leases(owner_id, queue: str) -> list[int]:
    """The chunks the owner's Celery-run chunks hold on `queue` (fresh heartbeat), oldest lease first."""
    fresh = timezone.now() - timedelta(seconds=settings.JOBS_LEASE_TIMEOUT_S)
    rows = (JobChunk.objects.filter(state=JobChunk.State.RUNNING, heartbeat_at__gte=fresh, job__owner_id=owner_id,
                                    job__state__in=JobState.RUNNABLE, lease_owner__contains=":celery:")
            .order_by("started_at", "pk").values_list("pk", "job__endpoint__worker_queue", "job__endpoint__name"))
    default = settings.CELERY_TASK_DEFAULT_QUEUE
    return [pk for pk, own_queue, name in rows
            if (own_queue or settings.JOBS_ENDPOINT_QUEUES.get(name) or default) == queue]


def _others_waiting(owner_id, queue: str) -> bool:
    return bool(_work_on(queue, waiting_only=True) - {owner_id})


def over_share(job, *, holding: int | None = None) -> bool:
    """Whether `job`'s owner is at (starting a chunk) or over (holding chunk `holding`) their share on the job's
    queue while another user waits there."""
    queue = queue_of(job)
    limit = share(queue)
    if limit is None:
        return False
    held = held_leases(job.owner_id, queue)
    if holding is None:
        over = len(held) >= limit
    else:  # the newest leases give way first
        over = holding in held and held.index(holding) + 1 > limit
    return over and _others_waiting(job.owner_id, queue)


def requeued_over_share(chunk_id) -> bool:
    """Called once by the chunk task before it runs the chunk: when the chunk's owner is at their share while
    another user waits, the message goes back to the queue with a countdown (the chunk stays pending) and True
    is returned. Anything else (done, leased, not runnable) is left to the runtime."""
    chunk = (JobChunk.objects.filter(pk=chunk_id, state=JobChunk.State.PENDING)
             .select_related("job", "job__endpoint").first())
    if chunk is None or chunk.job.state not in JobState.RUNNABLE or not over_share(chunk.job):
        return False
    delay = settings.JOBS_FAIR_SHARE_RETRY_S
    # dispatched again now: the watchdog must not take the waiting chunk for a lost message
    JobChunk.objects.filter(pk=chunk_id, state=JobChunk.State.PENDING).update(dispatched_at=timezone.now())
    from controlplane.celery import registered_app

    registered_app().tasks[RUN_CHUNK_TASK].apply_async((chunk_id,), countdown=delay, queue=queue_of(chunk.job))
    logger.info("job %s chunk %s: its owner holds their fair share of the workers while others wait; "
                "queued again in %g s", chunk.job_id, chunk.index, delay)
    return True


# --- hand-back on SIGTERM -----------------------------------------------------------------------------------
# Set when this worker process is asked to stop (SIGTERM from `docker compose stop` or systemd, SIGINT, SIGQUIT):
# Celery's warm shutdown would run every held chunk to its end (and docker kills the worker 10 s later), so each
# running chunk stops its engine run instead, writes what it has and hands the chunk back for another worker.
HANDING_BACK = threading.Event()


def _hand_back_on_stop(**_):
    HANDING_BACK.set()


worker_signals.on("worker_shutting_down", _hand_back_on_stop, "capacity-hand-back")


def hand_back_lease(chunk_id, lease_owner) -> bool:
    """Give the chunk back (pending) keeping the name of its last holder: a resume slot of another worker may take
    it at once (controlplane/jobs/resume.py), and its message is sent again too."""
    return CHUNK_LEASE.release(chunk_id, lease_owner, heartbeat_at=timezone.now())


# --- the running chunk ------------------------------------------------------------------------------------
class ChunkGuard:
    """The chunk's control (DbControl), plus: stop at the run's total deadline, yield the lease when the owner
    holds more than their share while another user waits, and hand the chunk back when the worker is asked to
    stop. `stopped_for` says which ("deadline", "share", "handback") once the engine was told to cancel."""

    def __init__(self, inner, *, job, chunk, deadline_s: float | None = None, check_every_s: float | None = None):
        self.inner = inner
        self.job, self.chunk_id = job, chunk.pk
        self.deadline_s = settings.JOBS_CHUNK_DEADLINE_S if deadline_s is None else deadline_s
        self.check_every_s = settings.JOBS_FAIR_SHARE_CHECK_S if check_every_s is None else check_every_s
        self.started = time.monotonic()
        self.next_check = self.started + self.check_every_s
        self.stopped_for: str | None = None

    def __getattr__(self, name):  # everything else is the inner control's
        return getattr(self.inner, name)

    @property
    def handed_back(self) -> bool:
        return self.stopped_for == "handback"

    def poll(self) -> ControlState:
        if self.stopped_for:
            return ControlState(action="cancel")
        if HANDING_BACK.is_set():
            logger.warning("job %s chunk %s: this worker is stopping; handing the chunk back", self.job.pk,
                           self.chunk_id)
            self.stopped_for = "handback"
            return ControlState(action="cancel")
        now = time.monotonic()
        if now - self.started >= self.deadline_s:
            logger.warning("job %s chunk %s: total deadline of %g s reached; stopping the run",
                           self.job.pk, self.chunk_id, self.deadline_s)
            self.stopped_for = "deadline"
            return ControlState(action="cancel")
        state = self.inner.poll()
        if state.action == "run" and now >= self.next_check:
            self.next_check = now + self.check_every_s
            try:
                if self.inner.db.call(over_share, self.job, holding=self.chunk_id):
                    logger.info("job %s chunk %s: its owner holds more than their fair share while others wait; "
                                "handing the chunk back", self.job.pk, self.chunk_id)
                    self.stopped_for = "share"
                    return ControlState(action="cancel")
            except Exception:  # noqa: BLE001 - never stop a run because the check failed
                logger.exception("job %s: the fair-share check failed", self.job.pk)
        return state

    def deadline_failure(self, stored_in_run: int) -> str | None:
        """The job's failure message when the run stopped at its deadline having stored nothing, else None."""
        if self.stopped_for != "deadline" or stored_in_run:
            return None
        return (f"chunk stored no rollout within its total deadline of {self.deadline_s:g} s "
                f"(JOBS_CHUNK_DEADLINE_S): the model server answered too slowly or not at all")


def guard(control, *, job, chunk) -> ChunkGuard:
    return ChunkGuard(control, job=job, chunk=chunk)


def queue_slots(queue: str) -> int | None:
    """Slots the live workers hold for `queue`, or None with no Redis to ask (controlplane.lanes)."""
    if _redis() is None:
        return None
    return collection_slots(queue)
