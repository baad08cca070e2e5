from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "controlplane.dashboard"
    label = "dashboard"

    def ready(self):
        from controlplane import telemetry

        from . import heartbeat, sessions

        heartbeat.connect_signals()
        sessions.connect_signals()
        telemetry.register_scrape_collector(heartbeat.WorkersCollector())
        register_builtin_panel_contexts()


def register_builtin_panel_contexts():
    from django.conf import settings

    from controlplane.jobs.services import chunk_queue
    from controlplane.jobs.verification import panel_context
    from controlplane.jobs.workers import job_workers
    from controlplane.panels import register_panel

    def workers(request, job):
        from django.utils import timezone

        # as_of: when the figures were read (a rate moves; the page says which moment it shows)
        return {"workers": job_workers(job), "queue": chunk_queue(job) or settings.CELERY_TASK_DEFAULT_QUEUE,
                "as_of": timezone.now()}

    register_panel("dashboard/panels/verification.html", name="verification",
                   context=lambda request, job: panel_context(job))
    register_panel("dashboard/panels/workers.html", name="workers", context=workers)
