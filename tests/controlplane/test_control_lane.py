"""The control lane (controlplane/lanes.py): control tasks go to CELERY_CONTROL_QUEUE, chunks never do, and no
endpoint may route chunks onto it."""
from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane import lanes, operator
from controlplane.celery import app


def _queue_of(name, **options):
    return app.amqp.router.route(options, name, (), {}).get("queue").name


def test_control_tasks_take_the_control_queue_and_chunks_the_work_queue(settings):
    settings.CELERY_CONTROL_QUEUE = "ctl-x"
    for name in ["controlplane.endpoints.tasks.run_admin_action_task", "controlplane.endpoints.tasks.check_health_task",
                 "controlplane.endpoints.tasks.prewarm_task", "controlplane.jobs.tasks.watchdog",
                 "controlplane.jobs.tasks.finalize_job_task"]:
        assert _queue_of(name) == "ctl-x", name
    default = settings.CELERY_TASK_DEFAULT_QUEUE
    assert _queue_of("controlplane.jobs.tasks.run_chunk_task") == default
    assert _queue_of("controlplane.jobs.tasks.run_chunk_task", queue="gpu-a") == "gpu-a"  # an endpoint's queue
    assert _queue_of("controlplane.jobs.tasks.verify_job_task") == default
    for entry in settings.CELERY_BEAT_SCHEDULE.values():  # every beat task
        assert _queue_of(entry["task"]) == "ctl-x"
    settings.CELERY_CONTROL_QUEUE = ""  # the lane off: one queue for all
    assert _queue_of("controlplane.endpoints.tasks.run_admin_action_task") == default


def test_no_endpoint_may_route_chunks_onto_the_control_queue(settings):
    settings.CELERY_CONTROL_QUEUE = "control"
    settings.JOBS_WORKER_QUEUES = ["gpu-a", "control"]
    assert "control" not in operator.worker_queues()
    why = operator.queue_problem("control")
    assert why and "not a worker queue users may pick" in why
    assert operator.queue_problem("CONTROL", listed=False)  # at dispatch too
    assert operator.queue_problem("gpu-a") is None
    with pytest.raises(ImproperlyConfigured, match="CELERY_CONTROL_QUEUE"):
        operator.check_settings()
    settings.JOBS_WORKER_QUEUES = []
    settings.CELERY_TASK_DEFAULT_QUEUE = "control"  # chunks would land on the lane
    with pytest.raises(ImproperlyConfigured):
        operator.check_settings()


def test_the_lane_is_said_not_served_without_a_worker(settings):
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    settings.CELERY_CONTROL_QUEUE = "ctl-nobody-serves"
    st = lanes.control_served()
    assert st == {"queue": "ctl-nobody-serves", "lane": True, "served": False, "slots": 0}


def test_the_deployments_start_a_control_worker_that_takes_no_chunks():
    from pathlib import Path

    import yaml

    repo = Path(__file__).resolve().parents[2]
    services = yaml.safe_load((repo / "docker" / "compose.yml").read_text())["services"]
    control, worker = services["control"]["command"], services["worker"]["command"]
    assert control[control.index("-Q") + 1] == "${CELERY_CONTROL_QUEUE:-control}" and "-P" in control
    assert "control" not in worker[worker.index("-Q") + 1]  # the chunk workers never serve the lane
    gpu = yaml.safe_load((repo / "docker" / "compose.gpu-host.yml").read_text())["services"]["worker"]["command"]
    assert "control" not in gpu[gpu.index("-Q") + 1]
    demo = (repo / "scripts" / "demo.sh").read_text()
    assert 'start control "$VENV/bin/celery" -A controlplane worker -P threads -c 2 -Q "$CONTROL_QUEUE"' in demo
    assert 'start worker "$VENV/bin/celery" -A controlplane worker -P threads -c 4 -Q "$WORK_QUEUE"' in demo


@pytest.mark.django_db
def test_the_overview_says_when_no_worker_serves_the_control_lane(client, settings):
    from tests.factories import make_user

    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    settings.CELERY_CONTROL_QUEUE = "ctl-nobody-serves-2"
    client.force_login(make_user("lane-viewer"))
    page = client.get("/").content.decode()
    assert 'id="control-lane" data-served="no"' in page and "not served: no live worker consumes it" in page
    assert client.get("/overview.json").json()["control_lane"]["served"] is False
