from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "controlplane.alerts"
    label = "alerts"
    verbose_name = "Alerts"

    def ready(self):
        # Notices (controlplane.notices) from the jobs and endpoints apps become webhook deliveries; the job page
        # shows their log (controlplane.panels).
        from controlplane import notices
        from controlplane.panels import register_panel

        from .services import panel_context
        from .receivers import on_notice

        notices.register(on_notice)
        register_panel("alerts/panel.html", name="alerts", context=panel_context, after="errors")
