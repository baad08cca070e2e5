"""Total deadlines for Celery tasks. Workers run `-P threads`, where Celery's soft_time_limit / time_limit are
not enforced: a task that a slow or trickling server keeps busy would hold its worker slot for ever. So each task
bounds itself: the engine runs (chunks, verification runs, sweeps, model-server operations) are cancelled on their
event loop at their deadline; blocking work (health checks, pre-warm) runs in a helper thread that the task
stops waiting for at its deadline (Python cannot stop a thread: it is abandoned, and ends at its own network
timeouts), so the worker slot is free again either way."""
from __future__ import annotations

import threading
from typing import Any, Callable

from django.db import connections


class DeadlineExceeded(TimeoutError):
    """A task's total deadline passed; the message says which task and how long it was allowed."""


def call_with_deadline(fn: Callable[..., Any], seconds: float, what: str, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) in a helper thread; its result, or DeadlineExceeded once `seconds` have passed.
    The helper closes its own database connections when fn returns."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc
        finally:
            connections.close_all()

    helper = threading.Thread(target=run, name=f"deadline:{what}"[:60], daemon=True)
    helper.start()
    helper.join(seconds)
    if helper.is_alive():
        raise DeadlineExceeded(f"{what} passed its total deadline of {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")
