from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "controlplane.dashboard"
    label = "dashboard"

    def ready(self):
        from .heartbeat import connect_signals

        connect_signals()
