"""Things worth telling someone about (core: imports no app). The app where one happens emits it; the apps
that act on them (alerts: webhooks) register a listener from their ready():

    notices.emit("job.failed", owner_id=job.owner_id, endpoint_id=job.endpoint_id, job_id=job.pk, text=...)

Listeners run once the current transaction commits (never for a rolled-back change), must be quick (they
queue work; they never call out) and never break the code that emitted: an exception is logged."""
from __future__ import annotations

import logging
from typing import Callable

from django.db import transaction

log = logging.getLogger(__name__)

KINDS = ("job.completed", "job.failed", "job.stalled", "job.gate_failed", "control.slow")

_listeners: list[Callable[[str, dict], None]] = []


def register(listener: Callable[[str, dict], None]) -> None:
    if listener not in _listeners:
        _listeners.append(listener)


def _deliver(kind: str, info: dict) -> None:
    for listener in list(_listeners):
        try:
            listener(kind, info)
        except Exception:  # noqa: BLE001 - a notice never breaks what emitted it
            log.exception("notice %s: listener %r failed", kind, listener)


def emit(kind: str, /, **info) -> None:
    """Tell the listeners about `kind` after the current transaction commits (now, outside one)."""
    if kind not in KINDS:
        raise ValueError(f"unknown notice {kind!r}")
    if _listeners:
        transaction.on_commit(lambda: _deliver(kind, info))
