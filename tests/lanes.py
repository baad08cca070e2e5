"""The control lane in test workers (controlplane/lanes.py): control tasks (ops actions, finalization...) go to
CELERY_CONTROL_QUEUE, so a test worker that must run them consumes that queue too."""
from __future__ import annotations

import os


def control_queue(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return (env.get("CELERY_CONTROL_QUEUE", "control") or "").strip()


def serve_control(queues: str, env: dict | None = None) -> str:
    """`queues` (a -Q value) plus the control queue, when the lane is on."""
    control = control_queue(env)
    return f"{queues},{control}" if control and control not in queues.split(",") else queues
