"""Webhook deliveries on the control lane (controlplane.lanes): a delivery never runs behind a chunk, and a
slow receiver holds one control slot for at most WEBHOOK_TIMEOUT_S per attempt."""
from __future__ import annotations

from celery import shared_task

from .models import WebhookDelivery
from .services import attempt, matching, payload, retry_delay_s


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


def on_notice(kind: str, info: dict) -> None:
    """A notice (controlplane.notices): one delivery row per matching webhook, each sent by a control-lane task.
    Quick: two queries and a queue message each; nothing here calls out."""
    for hook in matching(kind, info):
        d = WebhookDelivery.objects.create(webhook=hook, event=kind, job_id=info.get("job_id"),
                                           payload=payload(kind, info))
        try:
            deliver_webhook_task.delay(d.pk)
        except Exception as exc:  # noqa: BLE001 - no broker: logged on the row, never raised into the job
            WebhookDelivery.objects.filter(pk=d.pk).update(state=WebhookDelivery.State.FAILED,
                                                           error=f"could not queue: {exc}"[:2000])
