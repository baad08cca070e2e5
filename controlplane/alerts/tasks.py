"""Webhook deliveries on the control lane (controlplane.lanes): a delivery never runs behind a chunk, and a
slow receiver holds one control slot for at most WEBHOOK_TIMEOUT_S per attempt."""
from __future__ import annotations

from celery import shared_task

from .models import WebhookDelivery
from .services import attempt, retry_delay_s


@shared_task(name="controlplane.alerts.tasks.deliver_webhook_task", ignore_result=True)
def deliver_webhook_task(delivery_id: int) -> str:
    d = WebhookDelivery.objects.select_related("webhook").filter(pk=delivery_id).first()
    if d is None or d.state != WebhookDelivery.State.PENDING:
        return "gone"
    done, _ = attempt(d)
    if not done:  # bounded: attempt() marks it failed after WEBHOOK_MAX_ATTEMPTS
        deliver_webhook_task.apply_async((delivery_id,), countdown=retry_delay_s(d.attempts))
        return "retrying"
    return "done"
