from django.apps import AppConfig


class ProfilingConfig(AppConfig):
    name = "controlplane.profiling"
    label = "profiling"
    verbose_name = "Profiling"

    def ready(self):
        try:
            from controlplane.dashboard.panels import register_compare_section, register_panel
        except Exception:  # the dashboard app is optional for this one
            return
        from .views import compare_context, panel_context

        register_panel("profiling/panel.html", name="profiling", context=panel_context, after="timing", live=True)
        register_compare_section("profiling/compare.html", name="profiling", context=compare_context)
