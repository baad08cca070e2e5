from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "controlplane.jobs"
    label = "jobs"

    def ready(self):
        # register the Celery tasks in every process: services send them by name
        from . import tasks  # noqa: F401
