"""The outbound-URL gate's policy, built from the settings in this one place (workers.outbound is the gate).

Every process on these settings (web, workers, beat, manage.py) installs it when Django starts
(controlplane.api.apps), so every call out - engine requests, replica probes, health, pre-warm, admin
operations, vLLM /metrics, NeMo Gym discovery and agents, the remote verifier, the judge, profiling /stats -
is checked against ENDPOINT_ALLOWED_HOSTS. It is read again whenever a session or call starts, so a changed
setting applies to the next call.
"""
from __future__ import annotations

from functools import lru_cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from workers import outbound


@lru_cache(maxsize=8)
def _build(allow: tuple[str, ...], max_bytes: int, timeout_s: float) -> outbound.OutboundPolicy:
    return outbound.OutboundPolicy(allow=allow, default_max_bytes=max_bytes, default_timeout_s=timeout_s)


def policy() -> outbound.OutboundPolicy:
    """The policy of the current settings."""
    return _build(tuple(settings.ENDPOINT_ALLOWED_HOSTS), int(settings.OUTBOUND_MAX_BYTES),
                  float(settings.OUTBOUND_TIMEOUT_S))


def install() -> None:
    """Install the settings' policy for this process; a malformed ENDPOINT_ALLOWED_HOSTS entry stops it here."""
    try:
        policy()
    except ValueError as exc:
        raise ImproperlyConfigured(f"ENDPOINT_ALLOWED_HOSTS: {exc}") from None
    outbound.use_policy(policy)


@lru_cache(maxsize=8)
def _build_public(allow: tuple[str, ...], max_bytes: int, timeout_s: float) -> outbound.OutboundPolicy:
    return outbound.OutboundPolicy(allow=("*", *allow), default_max_bytes=max_bytes, default_timeout_s=timeout_s,
                                   public_only=True)


def webhook_policy() -> outbound.OutboundPolicy:
    """Where webhooks (alerts) may go: any public address; a private or loopback one only when
    WEBHOOK_ALLOWED_HOSTS names it (a host, host:port or network). Small answers, a short total deadline."""
    return _build_public(tuple(getattr(settings, "WEBHOOK_ALLOWED_HOSTS", ())),
                         int(getattr(settings, "WEBHOOK_MAX_BYTES", 64 * 1024)),
                         float(getattr(settings, "WEBHOOK_TIMEOUT_S", 5.0)))
