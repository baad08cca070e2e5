from django.apps import AppConfig


class ProfilingConfig(AppConfig):
    name = "controlplane.profiling"
    label = "profiling"
    verbose_name = "Profiling"

    def ready(self):
        from controlplane.jobs.extensions import register_run_wrapper
        from controlplane.panels import register_compare_section, register_panel

        from .services import profile_run
        from .views import compare_context, panel_context

        register_run_wrapper("profiling", profile_run)

        register_panel("profiling/panel.html", name="profiling", context=panel_context, after="timing", live=True)
        register_compare_section("profiling/compare.html", name="profiling", context=compare_context)
