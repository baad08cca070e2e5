from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "controlplane.endpoints"
    label = "endpoints"

    def ready(self):
        # The job page takes extra panels (controlplane.dashboard.panels): rollouts per weight version.
        try:
            from controlplane.dashboard.panels import register_panel
        except Exception:  # the dashboard app is optional for this one
            return
        from .versions import panel_context

        register_panel("dashboard/panels/weight_versions.html", name="weight-versions", context=panel_context,
                       after="timing")
