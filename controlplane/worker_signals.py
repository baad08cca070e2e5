"""Receivers of the Celery worker's signals (worker_ready, worker_shutdown, worker_shutting_down), registered by the
apps and connected only in a worker process (controlplane.celery, at its worker_init): importing celery.signals
costs 0.16-0.24 s, which a process that is no worker -- the drop-in CLI above all -- no longer pays at its start."""
from __future__ import annotations

import threading
from typing import Callable

_receivers: list[tuple[str, Callable, str]] = []
_connected = False
_lock = threading.Lock()


def on(signal_name: str, receiver: Callable, uid: str) -> Callable:
    """Connect `receiver` to celery.signals.<signal_name> in a worker (at once if this process is one already)."""
    with _lock:
        _receivers.append((signal_name, receiver, uid))
        if _connected:
            _connect(signal_name, receiver, uid)
    return receiver


def connect_all() -> None:
    """This process is a worker: connect what the apps registered, and what they register from now on."""
    global _connected
    with _lock:
        _connected = True
        for item in _receivers:
            _connect(*item)


def _connect(signal_name: str, receiver: Callable, uid: str) -> None:
    from celery import signals

    getattr(signals, signal_name).connect(receiver, weak=False, dispatch_uid=uid)
