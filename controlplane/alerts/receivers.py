"""The alerts app's notice listener (controlplane.notices), apart from its Celery tasks: Django's set-up registers
it without importing Celery; the task module is imported when a delivery is queued."""
from __future__ import annotations

from .models import WebhookDelivery
from .services import matching, payload


def on_notice(kind: str, info: dict) -> None:
    """A notice (controlplane.notices): one delivery row per matching webhook, each sent by a control-lane task.
    Quick: two queries and a queue message each; nothing here calls out."""
    hooks = list(matching(kind, info))
    if not hooks:
        return
    from .tasks import deliver_webhook_task

    for hook in hooks:
        d = WebhookDelivery.objects.create(webhook=hook, event=kind, job_id=info.get("job_id"),
                                           payload=payload(kind, info))
        try:
            deliver_webhook_task.delay(d.pk)
        except Exception as exc:  # noqa: BLE001 - no broker: logged on the row, never raised into the job
            WebhookDelivery.objects.filter(pk=d.pk).update(state=WebhookDelivery.State.FAILED,
                                                           error=f"could not queue: {exc}"[:2000])
