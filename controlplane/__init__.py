import os

import workers  # noqa: F401 - serializes ast.parse in every Django process (workers.threadsafe_ast)

# Load the Celery app with Django so @shared_task binds to it. Not in `manage.py collect_rollouts` (the drop-in CLI
# runs its job in its own process): creating the app there cost ~0.2 s before its first request; the few paths
# that send a task import controlplane.celery themselves, which creates it then.
if os.environ.get("CONTROLPLANE_LEAN_CLI") != "1":
    from .celery import app as celery_app

    __all__ = ("celery_app",)
