"""Webhooks (Slack-compatible JSON, HMAC-signed) and the log of their deliveries."""
from __future__ import annotations

from django.conf import settings
from django.db import models

from controlplane.fieldcrypt import EncryptedTextField

EVENTS = [("job.completed", "job completed"), ("job.failed", "job failed"), ("job.stalled", "job stalled"),
          ("job.gate_failed", "job's gate failed"), ("control.slow", "control action over its threshold")]


class Webhook(models.Model):
    """Where to send what: a user's webhook gets the notices of their jobs and endpoints; one tied to an
    endpoint only those of jobs on it and of its control actions."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhooks")
    endpoint = models.ForeignKey("endpoints.Endpoint", null=True, blank=True, on_delete=models.CASCADE,
                                 related_name="webhooks", help_text="Only this endpoint's jobs and actions")
    name = models.CharField(max_length=200, blank=True)
    url = models.URLField(max_length=2000)
    secret = EncryptedTextField(help_text="HMAC-SHA256 key of the X-Rollout-Signature header")
    events = models.JSONField(default=list, help_text="Event names; empty: all")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def wants(self, kind: str) -> bool:
        return self.enabled and (not self.events or kind in self.events)

    def __str__(self):
        return f"webhook {self.pk} -> {self.url}"


class WebhookDelivery(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"  # every attempt failed (or the answer was not 2xx)
        REFUSED = "refused"  # the outbound gate refused the URL: nothing was sent

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=40)
    job = models.ForeignKey("jobs.CollectionJob", null=True, blank=True, on_delete=models.SET_NULL,
                            related_name="webhook_deliveries")
    payload = models.JSONField()
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    response_status = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    duration_ms = models.FloatField(null=True, blank=True, help_text="the last attempt")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["job", "id"], name="webhook_delivery_job_id")]
