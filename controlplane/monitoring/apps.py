from django.apps import AppConfig


class MonitoringConfig(AppConfig):
    name = "controlplane.monitoring"
    label = "monitoring"

    def ready(self):
        from .worker import connect_signals

        connect_signals()
