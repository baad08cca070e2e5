"""Health checks, pre-warm and ops actions (pause, resume, weight updates...) run here, in a Celery
worker: the web process only enqueues them, so a user-registered URL is never called from the web
process. Results land on the endpoint (last_health / last_health_at, last_prewarm) or on the
`AdminAction` row (the model keeps its old name: see models.py)."""
from __future__ import annotations

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from controlplane.deadlines import DeadlineExceeded, call_with_deadline

from .models import Endpoint
from . import services

# Celery's time limits are not enforced under `-P threads`: each task bounds itself (controlplane/deadlines.py).


@shared_task(ignore_result=True)
def check_health_task(endpoint_id: int) -> bool:
    endpoint = Endpoint.objects.filter(pk=endpoint_id).first()
    if endpoint is None:
        return False
    try:  # the servers are called in a helper thread; the result is stored from this one
        result = call_with_deadline(services.check_health, settings.ENDPOINT_TASK_DEADLINE_S, "the health check",
                                    endpoint, save=False)
    except DeadlineExceeded as exc:
        result = {"ok": False, "checked_at": timezone.now().isoformat(), "replicas": [],
                  "error": f"{exc}: a replica answers too slowly"}
    Endpoint.objects.filter(pk=endpoint_id).update(last_health=result, last_health_at=timezone.now())
    return result["ok"]


@shared_task(ignore_result=True)
def prewarm_task(endpoint_id: int, n: int = 4) -> bool:
    endpoint = Endpoint.objects.filter(pk=endpoint_id).first()
    if endpoint is None:
        return False
    n = max(0, min(int(n), 64))
    try:
        result = call_with_deadline(services.prewarm, settings.ENDPOINT_TASK_DEADLINE_S, "the pre-warm", endpoint, n=n)
    except DeadlineExceeded as exc:
        result = {"ok": False, "sent": n, "succeeded": 0, "latencies_ms": [],
                  "errors": [f"{exc}: a replica answers too slowly"]}
    result["at"] = timezone.now().isoformat()
    Endpoint.objects.filter(pk=endpoint_id).update(last_prewarm=result)
    return result["ok"]


# A weight update waits on its own per-request timeouts (pause 120 s, update 600 s, resume 30 s) with bounded
# retries; the whole action stops at OPS_ACTION_DEADLINE_S (recorded failed; a resume is still sent).
# The name keeps "admin" on purpose: it is the task's registered name, carried by messages already in the broker
# (and by a resend after Redis lost its data); renaming it would leave those unregistered across a deploy.
@shared_task(bind=True, ignore_result=True)
def run_admin_action_task(self, action_id: int) -> str | None:
    from . import ops

    # a weight update behind an earlier one of the same endpoint: sent again shortly, never holding a control
    # slot while it waits (the watchdog and other actions go on)
    if not self.request.is_eager and ops.waits_for_earlier_update(action_id):
        self.apply_async((action_id,), countdown=ops.ORDER_RETRY_S)
        return "waiting"
    return ops.execute(action_id)


def enqueue(kind: str, endpoint, n: int | None = None) -> None:
    """Send the health check or pre-warm (of n requests, default 4) of this endpoint to a worker. Raises
    kombu/redis errors when the broker is down (callers answer 503)."""
    if kind == "health":
        check_health_task.delay(endpoint.pk)
    else:
        prewarm_task.delay(endpoint.pk, *([] if n is None else [n]))
