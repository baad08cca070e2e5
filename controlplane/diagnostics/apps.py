from django.apps import AppConfig


class DiagnosticsConfig(AppConfig):
    name = "controlplane.diagnostics"
    label = "diagnostics"
    verbose_name = "Diagnostics"

    def ready(self):
        # The job page takes extra panels (controlplane.dashboard.panels): add the diagnosis panel.
        try:
            from controlplane.dashboard.panels import register_panel
        except Exception:  # the dashboard app is optional for this one
            return
        from .views import panel_context

        register_panel("diagnostics/panel.html", name="diagnosis", context=panel_context, after="charts")
