"""Two lanes of Celery work: collection chunks on the work queues, everything else on the control queue.

A control task (an ops action or weight update, a health check or pre-warm, the watchdog and every beat
task, a job's finalization) must never wait behind collection: a chunk runs for minutes and holds its worker
slot all that time. So the control tasks go to CELERY_CONTROL_QUEUE, served by a worker of its own (`make demo`,
docker/compose.yml: `celery worker -Q control -P threads -c 2`), whose slots never hold a chunk. Chunks, batch
verification and sweeps stay on the work queues (CELERY_TASK_DEFAULT_QUEUE, an endpoint's worker queue).

CELERY_CONTROL_QUEUE="" turns the lane off: every task goes to the default queue (the old topology; the
bench's "before").
"""
from __future__ import annotations

from django.conf import settings

CONTROL_TASKS = frozenset({
    "controlplane.endpoints.tasks.run_admin_action_task",
    "controlplane.endpoints.tasks.check_health_task",
    "controlplane.endpoints.tasks.prewarm_task",
    "controlplane.jobs.tasks.watchdog",
    "controlplane.jobs.tasks.finalize_job_task",
    "controlplane.alerts.tasks.deliver_webhook_task",  # alerts: never behind a chunk, never holding one up
})


def control_queue() -> str:
    """The control lane's queue, or "" when the lane is off."""
    return (getattr(settings, "CELERY_CONTROL_QUEUE", "") or "").strip()


def is_control(task_name: str) -> bool:
    if task_name in CONTROL_TASKS:
        return True
    beat = getattr(settings, "CELERY_BEAT_SCHEDULE", {}) or {}
    return any(entry.get("task") == task_name for entry in beat.values())


def route_task(name, args, kwargs, options, task=None, **_):
    """Celery router (task_routes): control tasks to the control queue. A queue given explicitly when sending
    (a chunk's endpoint queue) wins over this route."""
    queue = control_queue()
    if queue and is_control(name):
        return {"queue": queue}
    return None


# How many slots the live workers hold per queue, or None with no Redis to ask: the jobs app (which keeps that
# registry, controlplane/jobs/capacity.py) sets it in its ready(), so this core module imports no app.
_slots_reader = None


def register_slots_reader(reader) -> None:
    global _slots_reader
    _slots_reader = reader


def control_served() -> dict:
    """Whether a live worker consumes the control queue: {"queue", "lane", "served": bool | None, "slots"}.
    Read from the registry the workers keep in Redis (controlplane/jobs/capacity.py: each worker registers its
    slots per queue it consumes, renewed every 15 s, gone within a minute of its death). served None: no Redis
    broker to ask (eager tasks: always served)."""
    queue = control_queue() or settings.CELERY_TASK_DEFAULT_QUEUE
    out = {"queue": queue, "lane": bool(control_queue()), "served": None, "slots": 0}
    if settings.CELERY_TASK_ALWAYS_EAGER:
        out["served"] = True
        return out
    slots = _slots_reader(queue) if _slots_reader is not None else None
    if slots is None:
        return out
    out["slots"] = slots
    out["served"] = slots > 0
    return out


NOT_SERVED = ("no worker serves the control queue {queue!r}: the action waits until one starts "
              "(`celery -A controlplane worker -Q {queue} -P threads -c 2`)")
