"""Celery application: settings come from Django under the CELERY_ namespace."""
import os

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


_registered = False


def registered_app() -> Celery:
    """The app with every installed app's tasks registered, for a process that sends a task by its name: a worker
    imports the tasks modules at its start (autodiscover); the apps no longer import them when Django sets up, so
    the drop-in CLI, which sends none, starts without Celery (0.12-0.2 s)."""
    global _registered
    if not _registered:
        app.autodiscover_tasks(force=True)  # imports each app's tasks module; no system checks, unlike a worker's
        _registered = True
    return app


@worker_init.connect
def _connect_worker_signals(**_):
    """The apps' receivers of the worker's signals (controlplane.worker_signals): connected in a worker only."""
    from controlplane.worker_signals import connect_all

    connect_all()


@worker_init.connect
def _raise_open_file_limit(**_):
    """Every request in flight holds a socket: lift the soft open-file limit to the hard one at start."""
    from workers.engine.fdlimit import raise_open_file_limit

    raise_open_file_limit()
