"""Health checks, pre-warm and admin actions (pause, resume, weight updates...) run here, in a Celery
worker: the web process only enqueues them, so a user-registered URL is never called from the web
process. Results land on the endpoint (last_health / last_health_at, last_prewarm) or on the
`AdminAction` row."""
from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from .models import Endpoint
from . import services


@shared_task(ignore_result=True, soft_time_limit=120, time_limit=150)
def check_health_task(endpoint_id: int) -> bool:
    endpoint = Endpoint.objects.filter(pk=endpoint_id).first()
    if endpoint is None:
        return False
    return services.check_health(endpoint)["ok"]


@shared_task(ignore_result=True, soft_time_limit=150, time_limit=180)
def prewarm_task(endpoint_id: int, n: int = 4) -> bool:
    endpoint = Endpoint.objects.filter(pk=endpoint_id).first()
    if endpoint is None:
        return False
    result = services.prewarm(endpoint, n=max(0, min(int(n), 64)))
    result["at"] = timezone.now().isoformat()
    Endpoint.objects.filter(pk=endpoint_id).update(last_prewarm=result)
    return result["ok"]


# A weight update may wait on its own per-request timeouts (pause 120 s, update 600 s, resume 30 s) with
# bounded retries; past the soft limit the action is recorded as failed.
@shared_task(ignore_result=True, soft_time_limit=1800, time_limit=1900)
def run_admin_action_task(action_id: int) -> str | None:
    from . import admin_ops

    return admin_ops.execute(action_id)


def enqueue(kind: str, endpoint, n: int | None = None) -> None:
    """Send the health check or pre-warm (of n requests, default 4) of this endpoint to a worker. Raises
    kombu/redis errors when the broker is down (callers answer 503)."""
    if kind == "health":
        check_health_task.delay(endpoint.pk)
    else:
        prewarm_task.delay(endpoint.pk, *([] if n is None else [n]))
