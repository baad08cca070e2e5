"""Total deadlines on every Celery task. Workers run `-P threads`, where Celery's time limits are not enforced: a
server that trickles its answer one byte at a time (every read succeeds, no read timeout fires) or never answers
held every worker thread for ever. Here one real worker with two threads gets a health check of a trickling
server, a job chunk, an admin pause and a parallelism sweep against a server that never answers: each ends at its
deadline with the reason recorded, and the worker is free for the next task."""
from __future__ import annotations

import uuid

import pytest
from celery import Celery
from django.conf import settings

from controlplane.diagnostics import services as diagnostics
from controlplane.diagnostics.models import ParallelismSweep
from controlplane.endpoints.models import AdminAction, Endpoint
from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobState
from tests.factories import make_dataset, make_endpoint, make_user

from .slow_servers import Worker, hanging_server, send_chunks, trickling_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


def _send(queue, task, *args):
    sender = Celery("security-sender", broker=settings.CELERY_BROKER_URL, set_as_current=False)
    with sender.connection_for_write() as conn:
        sender.send_task(task, args=list(args), queue=queue, connection=conn)


def test_every_task_ends_at_its_deadline_and_frees_the_worker(simulator, tmp_path):
    trickle, hang = trickling_server(0.5), hanging_server()
    mallory = make_user("mallory")
    queue = f"deadline-{uuid.uuid4().hex[:10]}"
    worker = Worker(queue, tmp_path, concurrency=2, ENDPOINT_TASK_DEADLINE_S=3, JOBS_CHUNK_DEADLINE_S=4,
                    OPS_ACTION_DEADLINE_S=3, DIAGNOSTICS_SWEEP_DEADLINE_S=3)
    try:
        ep_trickle = make_endpoint(mallory, trickle.url, name="trickle", request_timeout_s=600)
        ep_hang = make_endpoint(mallory, hang.url, name="hang", request_timeout_s=600, connect_timeout_s=5,
                                max_retries=0)
        _send(queue, "controlplane.endpoints.tasks.check_health_task", ep_trickle.pk)
        job = services.create_job(owner=mallory, dataset=make_dataset(mallory, n=2), endpoint=ep_hang,
                                  num_samples_in_parallel=2, launch=False)
        send_chunks(job, queue)
        action = AdminAction.objects.create(endpoint=ep_hang, trace_id=uuid.uuid4().hex, kind="pause",
                                            params={"mode": "keep"}, requested_by=mallory)
        _send(queue, "controlplane.endpoints.tasks.run_admin_action_task", action.pk)
        sweep = diagnostics.create_sweep(endpoint=ep_hang, dataset=job.dataset, owner=mallory, sample_size=2,
                                         levels=[1, 2])
        _send(queue, "controlplane.diagnostics.tasks.run_sweep_task", sweep.pk)

        def health_recorded():
            return (Endpoint.objects.get(pk=ep_trickle.pk).last_health or {}).get("error")

        error = wait_for(health_recorded, 60, "the health check of a trickling server never ended", worker.tail)
        assert "deadline of 3 s" in error

        def job_failed():
            job.refresh_from_db()
            return job.state == JobState.FAILED

        wait_for(job_failed, 60, "the chunk held by a server that never answers never ended", worker.tail)
        assert "deadline of 4 s" in job.error_message

        def action_done():
            action.refresh_from_db()
            return action.state in AdminAction.FINISHED

        wait_for(action_done, 60, "the ops action never ended", worker.tail)
        assert action.state == "failed" and "deadline" in action.error

        def sweep_done():
            sweep.refresh_from_db()
            return sweep.state not in ("queued", "running")

        wait_for(sweep_done, 60, "the sweep never ended", worker.tail)
        assert sweep.state == ParallelismSweep.State.FAILED and "deadline" in sweep.error_message

        # the worker's threads are free again: a health check of a good server goes through
        ep_ok = make_endpoint(mallory, simulator.url, model=simulator.model, name="ok")
        _send(queue, "controlplane.endpoints.tasks.check_health_task", ep_ok.pk)
        wait_for(lambda: (Endpoint.objects.get(pk=ep_ok.pk).last_health or {}).get("ok"), 30,
                 "the next task did not run", worker.tail)
        assert CollectionJob.objects.get(pk=job.pk).state == JobState.FAILED
    finally:
        worker.stop()
        trickle.close()
        hang.close()
