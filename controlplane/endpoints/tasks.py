"""Health checks and pre-warm run here, in a Celery worker: the web process only enqueues them, so a
user-registered URL is never called from the web process. Results land on the endpoint
(last_health / last_health_at, last_prewarm)."""
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


def enqueue(kind: str, endpoint) -> None:
    """Send the health check or pre-warm of this endpoint to a worker. Raises kombu/redis errors when
    the broker is down (callers answer 503)."""
    task = check_health_task if kind == "health" else prewarm_task
    task.delay(endpoint.pk)
