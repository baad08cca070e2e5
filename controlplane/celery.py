"""Celery application: settings come from Django under the CELERY_ namespace."""
import os

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
def _raise_open_file_limit(**_):
    """Every request in flight holds a socket: lift the soft open-file limit to the hard one at start."""
    from workers.engine.fdlimit import raise_open_file_limit

    raise_open_file_limit()
