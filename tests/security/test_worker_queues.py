"""A hostile user routes an endpoint to `worker_queue: "unacked"`: the chunk messages landed on kombu's own
key and every worker on that Redis exited (and died again on restart). A user picks a queue from the
operator's list (JOBS_WORKER_QUEUES, the default queue, JOBS_ENDPOINT_QUEUES' queues): refused at the edge
(API, dashboard form, model validation used by the admin) and again at dispatch, where a stored endpoint
with a broker-reserved name (one saved before the checks) fails its job with the reason and sends nothing
to the broker (real Redis)."""
from __future__ import annotations

import pytest
import redis
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured, ValidationError

from controlplane.endpoints.models import Endpoint
from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobState

from .conftest import make_dataset, make_endpoint

RESERVED = ["unacked", "unacked_index", "unacked_mutex", "_kombu.binding.celery", "celery.pidbox",
            "reply.celery.pidbox", "worker1@host.celery.pidbox", "celeryev", "celeryev.1234"]


@pytest.fixture
def broker():
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    yield client
    client.close()


def _broker_keys(broker, names):
    """(type, size) of each key: what a chunk message pushed onto it would change."""
    out = {}
    for name in names:
        kind = broker.type(name).decode()
        size = {"list": broker.llen, "hash": broker.hlen, "zset": broker.zcard, "set": broker.scard}.get(kind)
        out[name] = (kind, size(name) if size else None)
    return out


@pytest.mark.parametrize("queue", RESERVED + ["not-declared", "gpu a;rm"])
def test_edge_refuses_queues_the_operator_did_not_declare(api, web, mallory, settings, queue):
    settings.JOBS_WORKER_QUEUES = ["gpu-a", *RESERVED]  # even an operator's list cannot make these pickable
    r = api.post("/api/endpoints/", {"name": "x", "base_url": "http://127.0.0.1:9", "model_name": "m",
                                     "worker_queue": queue}, format="json")
    assert r.status_code == 400 and "worker_queue" in r.json(), r.content
    ep = make_endpoint(mallory)
    r = api.patch(f"/api/endpoints/{ep.pk}/", {"worker_queue": queue}, format="json")
    assert r.status_code == 400 and "worker_queue" in r.json(), r.content
    r = web.post("/endpoints/", {"name": "x", "kind": "vllm", "base_url": "http://127.0.0.1:9", "model_name": "m",
                                 "api_flavor": "chat_completions", "request_timeout_s": 60, "connect_timeout_s": 5,
                                 "max_retries": 1, "worker_queue": queue})
    assert r.status_code in (200, 400) and Endpoint.objects.count() == 1  # the form shows its errors, saves nothing
    with pytest.raises(ValidationError) as err:  # the admin's and the forms' check
        Endpoint(name="x", base_url="http://127.0.0.1:9", model_name="m", worker_queue=queue).full_clean()
    assert "worker_queue" in err.value.message_dict
    assert list(Endpoint.objects.values_list("worker_queue", flat=True)) == [""]


def test_the_operators_queues_are_accepted(api, settings):
    from controlplane import operator

    settings.JOBS_WORKER_QUEUES = ["gpu-a"]
    settings.JOBS_ENDPOINT_QUEUES = {"big": "gpu-b"}
    for queue in ("gpu-a", "gpu-b", settings.CELERY_TASK_DEFAULT_QUEUE, ""):
        r = api.post("/api/endpoints/", {"name": f"x{queue}", "base_url": "http://127.0.0.1:9", "model_name": "m",
                                         "worker_queue": queue}, format="json")
        assert r.status_code == 201, (queue, r.content)
    assert operator.worker_queues() == ["gpu-a", settings.CELERY_TASK_DEFAULT_QUEUE, "gpu-b"]


def test_dispatch_refuses_a_reserved_queue_stored_behind_the_checks(api, mallory, broker,
                                                                    django_capture_on_commit_callbacks):
    ds = make_dataset(mallory)
    ep = make_endpoint(mallory)
    Endpoint.objects.filter(pk=ep.pk).update(worker_queue="unacked")  # an endpoint saved before the checks
    before = _broker_keys(broker, RESERVED)
    with django_capture_on_commit_callbacks(execute=True):
        r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "verifier": "math"}, format="json")
    assert r.status_code == 400 and "broker keeps such names" in " ".join(r.json()["endpoint"]), r.content
    assert not CollectionJob.objects.exists()
    # a job created earlier, re-dispatched by the watchdog: failed with the reason, nothing sent
    Endpoint.objects.filter(pk=ep.pk).update(worker_queue="")
    with django_capture_on_commit_callbacks(execute=False):
        job = services.create_job(owner=mallory, dataset=ds, endpoint=ep, launch=False)
    Endpoint.objects.filter(pk=ep.pk).update(worker_queue="unacked")
    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        assert services.dispatch_chunks(job) == []
    job.refresh_from_db()
    assert job.state == JobState.FAILED and "unacked" in job.error_message and "broker" in job.error_message
    # resuming it is refused with the same reason (400), before any state change
    with pytest.raises(ValidationError, match="broker keeps such names"):
        services.resume_job(job)
    assert _broker_keys(broker, RESERVED) == before


def test_every_process_refuses_to_start_with_a_reserved_queue_in_its_settings(settings):
    from controlplane import operator

    settings.JOBS_WORKER_QUEUES = ["gpu-a", "unacked"]
    with pytest.raises(ImproperlyConfigured, match="unacked"):
        operator.check_settings()
    settings.JOBS_WORKER_QUEUES = ["gpu-a"]
    settings.JOBS_ENDPOINT_QUEUES = {"x": "_kombu.binding.celery"}
    with pytest.raises(ImproperlyConfigured, match="_kombu"):
        operator.check_settings()
    settings.JOBS_ENDPOINT_QUEUES = {"x": "gpu-b"}
    operator.check_settings()
