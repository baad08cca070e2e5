"""Webhooks: which ones a notice goes to, the signed Slack-compatible body, and one delivery attempt through
the outbound gate (controlplane.outbound.webhook_policy). Deliveries run on the control lane's Celery queue
(tasks.deliver_webhook_task), so a slow or dead receiver never holds up a job: the job only queues them.

Signature: `X-Rollout-Timestamp: <unix seconds>` and `X-Rollout-Signature: v1=<hex>`, the HMAC-SHA256 with
the webhook's secret of `<timestamp>.<body>`. A receiver recomputes it over the raw body and rejects a stale
timestamp (replays)."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import time

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone
from controlplane.outbound import webhook_policy

from workers import outbound

from .models import Webhook, WebhookDelivery

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Rollout-Signature"
TIMESTAMP_HEADER = "X-Rollout-Timestamp"
PANEL_ROWS = 20


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    return "v1=" + hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str, *, max_age_s: float = 300.0) -> bool:
    """What a receiver does (and the tests): the signature matches and the timestamp is recent."""
    try:
        ts = int(timestamp)
    except (TypeError, ValueError):
        return False
    return abs(time.time() - ts) <= max_age_s and hmac.compare_digest(sign(secret, ts, body), signature or "")


def url_problem(url: str) -> str | None:
    """Why a receiver URL is refused (checked when a webhook is saved; the gate checks again on every send)."""
    return outbound.url_problem(url, webhook_policy())


def _text(kind: str, info: dict) -> str:
    job = f"job {info.get('job_id')}" + (f" {info['job_name']!r}" if info.get("job_name") else "")
    if kind == "job.completed":
        return f":white_check_mark: {job} completed: {info.get('detail', '')}"
    if kind == "job.failed":
        return f":x: {job} failed: {info.get('detail', '')}"
    if kind == "job.stalled":
        return f":warning: {job} stalled: {info.get('detail', '')}"
    if kind == "job.gate_failed":
        return f":no_entry: {job}: {info.get('detail', '')}"
    return (f":hourglass: control action {info.get('action_kind')} on endpoint {info.get('endpoint_id')} took "
            f"{info.get('total_ms', 0):.0f} ms (over {info.get('threshold_ms', 0):.0f} ms; waited "
            f"{info.get('dispatch_ms') or 0:.0f} ms for a worker), trace {info.get('trace_id')}")


def payload(kind: str, info: dict) -> dict:
    """Slack-compatible (`text`, shown by Slack, Mattermost, Teams' incoming webhooks and friends) with the
    event's fields for receivers that parse them."""
    return {"text": _text(kind, info), "event": kind, "sent_at": timezone.now().isoformat(),
            **{k: v for k, v in info.items() if k not in ("owner_id", "requested_by_id")}}


def matching(kind: str, info: dict) -> list[Webhook]:
    """The webhooks a notice goes to: the involved users' own (job owner, whoever asked for the action), and
    those tied to the notice's endpoint by one of them or by the endpoint's owner."""
    users = {u for u in (info.get("owner_id"), info.get("requested_by_id")) if u}
    q = Q(owner_id__in=users, endpoint=None)
    if info.get("endpoint_id"):
        q |= Q(endpoint_id=info["endpoint_id"]) & (Q(owner_id__in=users) | Q(owner_id=F("endpoint__owner_id")))
    return [w for w in Webhook.objects.filter(q, enabled=True).distinct() if w.wants(kind)]


def attempt(delivery: WebhookDelivery) -> tuple[bool, bool]:
    """Send once. (done, retry): done when it needs no other attempt (delivered, refused, or a 4xx)."""
    hook = delivery.webhook
    policy = webhook_policy()
    body = json.dumps(delivery.payload, separators=(",", ":"), sort_keys=True).encode()
    ts = int(time.time())
    headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: sign(hook.secret, ts, body),
               "User-Agent": "rollout-control-plane-webhook/1"}
    delivery.attempts += 1
    t0 = time.perf_counter()
    state, status, error, retry = WebhookDelivery.State.PENDING, None, "", False
    try:
        reply = outbound.fetch_sync("POST", hook.url, data=body, headers=headers, timeout_s=policy.default_timeout_s,
                                    max_bytes=policy.default_max_bytes, policy=policy)
        status = reply.status
        if 200 <= reply.status < 300:
            state = WebhookDelivery.State.DELIVERED
        else:
            error = f"answered HTTP {reply.status}"
            retry = reply.status >= 500 or reply.status == 429
    except outbound.OutboundRefused as exc:
        state, error = WebhookDelivery.State.REFUSED, f"refused: {exc.reason}"
    except outbound.OutboundError as exc:
        error, retry = f"{exc.failure_class}: {exc.reason}", exc.retryable
    if state == WebhookDelivery.State.PENDING and not (retry and delivery.attempts < settings.WEBHOOK_MAX_ATTEMPTS):
        state = WebhookDelivery.State.FAILED
    done = state != WebhookDelivery.State.PENDING
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        state=state, attempts=delivery.attempts, response_status=status, error=error[:2000],
        duration_ms=round((time.perf_counter() - t0) * 1000.0, 1), finished_at=timezone.now() if done else None)
    if error:
        log.warning("webhook %s delivery %s (%s) attempt %s: %s", hook.pk, delivery.pk, delivery.event,
                    delivery.attempts, error)
    return done, not done


def retry_delay_s(attempts: int) -> float:
    return float(settings.WEBHOOK_RETRY_BASE_S) * (4 ** max(attempts - 1, 0))


def panel_context(request, job) -> dict:
    """The job page's delivery log: this job's webhook deliveries, newest first."""
    rows = list(WebhookDelivery.objects.filter(job=job).select_related("webhook")[:PANEL_ROWS])
    return {"deliveries": rows, "has_hooks": bool(rows) or Webhook.objects.filter(owner_id=job.owner_id).exists()}
