from django.apps import AppConfig


class ExportsConfig(AppConfig):
    name = "controlplane.exports"
    label = "exports"
    verbose_name = "Exports to trackers"

    def ready(self):
        # A finished job (controlplane.notices) is exported to the trackers it asked for (MLflow) and its OpenTelemetry
        # job span is sent, by a task on the default queue (an export may take seconds; it never delays the job).
        from controlplane import notices

        from .receivers import on_notice

        notices.register(on_notice)
