from django.apps import AppConfig


class DiagnosticsConfig(AppConfig):
    name = "controlplane.diagnostics"
    label = "diagnostics"
    verbose_name = "Diagnostics"

    def ready(self):
        # The job page takes extra panels (controlplane.panels): add the diagnosis panel.
        from controlplane.limits import register_work_counter
        from controlplane.panels import register_panel

        from .services import active_sweeps_work
        from .views import panel_context

        register_work_counter("sweeps", active_sweeps_work)
        register_panel("diagnostics/panel.html", name="diagnosis", context=panel_context, after="charts")
