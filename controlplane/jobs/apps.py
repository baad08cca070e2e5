from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "controlplane.jobs"
    label = "jobs"

    def ready(self):
        # The Celery tasks are not imported here: a worker imports them at its start, a sender when it sends one
        # (controlplane.celery.registered_app), so the drop-in CLI starts without Celery.
        # every process refuses to start with a reserved queue name or bad verifier maxima
        from controlplane.operator import check_settings

        check_settings()
        from controlplane.limits import register_work_counter

        from .services import active_jobs_work

        register_work_counter("jobs", active_jobs_work)
        from controlplane.lanes import register_slots_reader

        from .capacity import queue_slots

        register_slots_reader(queue_slots)
        # weight versions of rollouts (versions.py): tagged after each weight update the endpoints app records,
        # and the job page's panel of rollouts per version
        from controlplane.endpoints.ops import register_update_hook
        from controlplane.panels import register_panel

        from . import versions

        register_update_hook(lambda endpoint: versions.last_rollout_id(), versions.after_update)
        register_panel("dashboard/panels/weight_versions.html", name="weight-versions", context=versions.panel_context,
                       after="timing")
        # the per-task reward profile (profile.py): summary and the tasks with the most reward variance
        from . import profile

        register_panel("dashboard/panels/task_profile.html", name="task-profile", context=profile.panel_context,
                       after="weight-versions")
        # open-ended collection (openended.py): the buffer's fill and the trainer's consumption
        from . import openended

        register_panel("dashboard/panels/open_ended.html", name="open-ended", context=openended.panel_context,
                       after="progress")
