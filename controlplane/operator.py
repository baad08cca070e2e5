"""Operator-only knobs: what a user may name or pick is chosen from what the operator declared.

- Verifiers: users name registered verifiers (built-ins, VERIFIER_PLUGINS, entry points) and dotted paths
  only into VERIFIER_PATH_MODULES; any other dotted path is refused before anything is imported (importing a
  module runs it, in the web process). manage.py commands are the operator's and keep dotted paths.
- Worker queues: an endpoint's worker_queue is one of JOBS_WORKER_QUEUES, the default queue or a queue of
  JOBS_ENDPOINT_QUEUES; names the broker keeps for itself (kombu's `unacked` keys, `_kombu.*` bindings,
  Celery's `*.pidbox` control queues and `celeryev*` event queues) never, not even when the operator lists
  them. Checked at every way in and again when chunks are dispatched.
- Whole-worker profiling (scope "worker") shows every tenant's calls in that worker: staff only.
"""
from __future__ import annotations

import re

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# kombu's Redis transport: the unacked hash and its index/mutex, the exchange bindings; Celery: the remote
# control (pidbox) and event queues. Pushing a chunk message onto one of these keys breaks every worker.
_RESERVED_EXACT = {"unacked", "unacked_index", "unacked_mutex", "celeryev", "celery.pidbox", "reply.celery.pidbox"}
_RESERVED_PATTERN = re.compile(r"^(_kombu|unacked|celeryev|reply\.)|pidbox|\x06\x16", re.IGNORECASE)


def reserved_queue(name: str) -> bool:
    """The broker's own names, and the control lane's queue (controlplane/lanes.py): chunks never go there."""
    control = (getattr(settings, "CELERY_CONTROL_QUEUE", "") or "").strip().lower()
    return (name.lower() in _RESERVED_EXACT or bool(_RESERVED_PATTERN.search(name))
            or bool(control and name.strip().lower() == control))


def reserved_queue_of_broker(name: str) -> bool:
    return name.lower() in _RESERVED_EXACT or bool(_RESERVED_PATTERN.search(name))


def worker_queues() -> list[str]:
    """The queues users may pick for an endpoint: the operator's list, the default queue and the
    JOBS_ENDPOINT_QUEUES queues, minus reserved names."""
    names = [*settings.JOBS_WORKER_QUEUES, settings.CELERY_TASK_DEFAULT_QUEUE, *settings.JOBS_ENDPOINT_QUEUES.values()]
    out = []
    for name in names:
        name = str(name).strip()
        if name and name not in out and QUEUE_NAME.fullmatch(name) and not reserved_queue(name):
            out.append(name)
    return out


def queue_problem(name: str, *, listed: bool = True) -> str | None:
    """Why `name` may not be an endpoint's worker queue, or None ("" is the default queue). `listed=False`
    (at dispatch): only what would break the broker is refused, so an endpoint saved before the operator's
    list existed keeps working on every host (GPU hosts' workers re-dispatch their own chunks too)."""
    if not name:
        return None
    if not isinstance(name, str) or not QUEUE_NAME.fullmatch(name) or reserved_queue(name):
        return (f"{str(name)[:100]!r} is not a worker queue users may pick: the broker keeps such names for itself "
                f"(choose one of: {', '.join(worker_queues())})")
    if listed and name not in worker_queues():
        return (f"{name!r} is not one of the operator's worker queues ({', '.join(worker_queues())}); the operator "
                "declares them in JOBS_WORKER_QUEUES")
    return None


def check_settings() -> None:
    """At startup of every process: the operator's queue and verifier settings make sense."""
    from workers.verifiers.base import operator_maxima

    named = [*settings.JOBS_WORKER_QUEUES, settings.CELERY_TASK_DEFAULT_QUEUE, *settings.JOBS_ENDPOINT_QUEUES.values()]
    bad = [q for q in named if q and (not QUEUE_NAME.fullmatch(str(q)) or reserved_queue(str(q)))]
    if bad:
        raise ImproperlyConfigured(f"worker queue name(s) {', '.join(map(repr, bad))} (JOBS_WORKER_QUEUES, "
                                   "CELERY_TASK_DEFAULT_QUEUE, JOBS_ENDPOINT_QUEUES) are reserved by the broker or "
                                   "malformed: letters, digits, _ . - only; not unacked*, _kombu*, *pidbox*, celeryev*, "
                                   "nor the control lane's CELERY_CONTROL_QUEUE")
    control = (getattr(settings, "CELERY_CONTROL_QUEUE", "") or "").strip()
    if control and (not QUEUE_NAME.fullmatch(control) or reserved_queue_of_broker(control)):
        raise ImproperlyConfigured(f"CELERY_CONTROL_QUEUE {control!r} is malformed or reserved by the broker")
    try:
        operator_maxima(settings.VERIFIER_OPTION_MAX)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None


# --------------------------------------------------------------------------------------------- verifiers
def path_modules() -> list[str]:
    """Modules into which users may name verifiers by dotted path."""
    return [*settings.VERIFIER_PATH_MODULES, *settings.VERIFIER_PLUGINS]


def check_user_verifier(name) -> None:
    """ValueError unless a user may name this verifier (nothing is imported for a refused name)."""
    from workers.verifiers.registry import check_user_name

    check_user_name(name, path_modules())


# --------------------------------------------------------------------------------------------- profiling
WORKER_SCOPE_REFUSED = ("profiling scope 'worker' profiles a whole worker process, every tenant's work on it "
                        "included: staff only. Use scope 'verify' for your job's verifier calls.")


def may_profile_worker(user) -> bool:
    return bool(getattr(user, "is_staff", False))
