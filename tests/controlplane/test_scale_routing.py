"""Scale, without extra processes: a job's chunks land on its endpoint's Celery queue (real Redis); the
workers of a job (host, pid, chunks held, rollouts/s, last heartbeat) as the page and the API show them,
from the lease and metric rows workers write; the open-file limit raised to the hard limit.
(The same with real workers in two network namespaces: test_two_hosts.py.)"""
from __future__ import annotations

import resource
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.jobs import services
from controlplane.jobs.models import JobChunk, JobMetricSample, Rollout
from controlplane.jobs.workers import job_workers
from workers.engine import fdlimit


@pytest.fixture
def broker():
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    yield client
    client.close()


def _queued_chunk_ids(broker, queue):
    import json

    ids = []
    for raw in reversed(broker.lrange(queue, 0, -1)):  # kombu LPUSHes: the oldest message is last
        message = json.loads(raw)
        assert message["headers"]["task"] == services.RUN_CHUNK_TASK
        ids.append(message["headers"]["argsrepr"])
    return ids


@pytest.mark.django_db
def test_chunks_go_to_the_endpoint_queue_then_the_settings_map_then_the_default(
        user, math_dataset, sim_endpoint, broker, settings, django_capture_on_commit_callbacks):
    gpu_a, gpu_b, default = (f"scale-{name}-{uuid.uuid4().hex[:8]}" for name in ("gpu-a", "gpu-b", "default"))
    from celery import current_app
    # Celery reads the setting from Django's settings while nothing overrides it in its own `changes`: the
    # override below goes there, so it is taken out again after (later tests set the Django setting)
    changes = current_app.conf.changes
    overridden, saved_default = "task_default_queue" in changes, changes.get("task_default_queue")
    settings.CELERY_TASK_DEFAULT_QUEUE = default
    settings.JOBS_ENDPOINT_QUEUES = {"mapped": gpu_b}
    current_app.conf.task_default_queue = default
    try:
        routed = sim_endpoint("http://127.0.0.1:9", name="routed", worker_queue=gpu_a)
        mapped = sim_endpoint("http://127.0.0.1:9", name="mapped")
        plain = sim_endpoint("http://127.0.0.1:9", name="plain")
        dataset = math_dataset(25)
        jobs = {}
        for ep in (routed, mapped, plain):
            with django_capture_on_commit_callbacks(execute=True):
                jobs[ep.name] = services.create_job(owner=user, dataset=dataset, endpoint=ep, chunk_size=10)
        chunk_ids = {name: [f"({pk},)" for pk in job.chunks.order_by("index").values_list("pk", flat=True)]
                     for name, job in jobs.items()}
        assert [len(v) for v in chunk_ids.values()] == [3, 3, 3]
        assert _queued_chunk_ids(broker, gpu_a) == chunk_ids["routed"]
        assert _queued_chunk_ids(broker, gpu_b) == chunk_ids["mapped"]
        assert _queued_chunk_ids(broker, default) == chunk_ids["plain"]
        # the watchdog's re-sends follow the same route
        with django_capture_on_commit_callbacks(execute=True):
            services.dispatch_chunks(jobs["routed"], [jobs["routed"].chunks.get(index=1).pk])
        assert _queued_chunk_ids(broker, gpu_a) == chunk_ids["routed"] + [chunk_ids["routed"][1]]
    finally:
        if overridden:
            changes["task_default_queue"] = saved_default
        else:
            changes.pop("task_default_queue", None)
        for cached in ("default_queue", "queues", "router"):  # built from this test's default: build them again
            current_app.amqp.__dict__.pop(cached, None)
        broker.delete(gpu_a, gpu_b, default)


def test_worker_queue_names_are_checked(db):
    from django.core.exceptions import ValidationError

    from controlplane.endpoints.models import Endpoint

    ep = Endpoint(name="x", base_url="http://127.0.0.1:9", model_name="m", worker_queue="gpu a;rm")
    with pytest.raises(ValidationError) as err:
        ep.full_clean()
    assert "worker_queue" in err.value.message_dict


def _lease(chunk, worker, heartbeat, state=JobChunk.State.RUNNING):
    JobChunk.objects.filter(pk=chunk.pk).update(state=state, lease_owner=f"{worker}#abcd1234", heartbeat_at=heartbeat)


@pytest.mark.django_db
def test_job_workers_on_the_page_and_in_the_api(user, math_dataset, sim_endpoint, client):
    job = services.create_job(owner=user, dataset=math_dataset(40), endpoint=sim_endpoint("http://127.0.0.1:9"),
                              chunk_size=10, launch=False)
    c0, c1, c2, c3 = job.chunks.order_by("index")
    now = timezone.now()
    a, b, dead = "gpu-a:101:celery:1", "gpu-b:202:celery:7", "gpu-c:303:celery:2"
    _lease(c0, a, now - timedelta(seconds=1))
    _lease(c1, b, now - timedelta(seconds=2))
    _lease(c2, a, now - timedelta(seconds=30), state=JobChunk.State.DONE)
    _lease(c3, dead, now - timedelta(seconds=settings.JOBS_LEASE_TIMEOUT_S + 60))  # stopped heartbeating
    job.state = "running"
    job.save(update_fields=["state"])
    # what each run reported (the dead one claimed 9 rollouts it never stored) ...
    samples = [(a, 0, 10, 4.0, 25.5, 32), (a, 2, 10, 30.0, 0.0, 0), (b, 1, 7, 3.0, 12.0, 16),
               (dead, 3, 9, settings.JOBS_LEASE_TIMEOUT_S + 60, 9.0, 8)]
    for worker, index, completed, age_s, rate, in_flight in samples:
        JobMetricSample.objects.create(job=job, worker=f"{worker} chunk {index}", t=now - timedelta(seconds=age_s + 5),
                                       elapsed_s=100.0, completed=completed - 1, samples_per_s=rate / 2,
                                       in_flight=in_flight)
        JobMetricSample.objects.create(job=job, worker=f"{worker} chunk {index}", t=now - timedelta(seconds=age_s),
                                       elapsed_s=105.0, completed=completed, failed=0, samples_per_s=rate,
                                       in_flight=in_flight)
    # ... and the rows each stored: the figures count these (a: 15 of its 20 in the last 10 s, b: 7)
    stored = [(a, 15, 2), (a, 5, 60), (b, 7, 1), (dead, 3, settings.JOBS_LEASE_TIMEOUT_S + 70)]
    k = 0
    for worker, n, age_s in stored:
        Rollout.objects.bulk_create([Rollout(job=job, task_index=k + i, rollout_index=0, data={}, worker=worker,
                                             created_at=now - timedelta(seconds=age_s)) for i in range(n)])
        k += n

    from controlplane.jobs import figures

    span = figures._recent_span(job.pk, now)  # the job ran through (almost) all of the rate window
    assert 9.0 <= span <= 10.0
    ra, rb = round(15 / span, 1), round(7 / span, 1)
    workers = {w["worker"]: w for w in job_workers(job, now=now)}
    assert set(workers) == {"gpu-a:101", "gpu-b:202", "gpu-c:303"}
    wa, wb, wd = workers["gpu-a:101"], workers["gpu-b:202"], workers["gpu-c:303"]
    assert (wa["host"], wa["pid"], wa["chunks_held"], wa["chunks_done"], wa["rollouts"], wa["rollouts_per_s"],
            wa["in_flight"], wa["alive"]) == ("gpu-a", 101, 1, 1, 20, ra, 32, True)
    assert (wb["chunks_held"], wb["rollouts"], wb["rollouts_per_s"], wb["alive"]) == (1, 7, rb, True)
    assert (wd["chunks_held"], wd["rollouts"], wd["rollouts_per_s"], wd["in_flight"], wd["alive"]) == (1, 3, 0.0, 0, False)
    assert [w["worker"] for w in job_workers(job, now=now)][-1] == "gpu-c:303"  # live ones first

    api = APIClient()
    api.force_authenticate(user)
    resp = api.get(f"/api/jobs/{job.pk}/workers/")
    assert resp.status_code == 200
    body = resp.json()
    assert body["job"] == job.pk
    got = {w["worker"]: (w["chunks_held"], w["rollouts_per_s"], w["alive"]) for w in body["workers"]}
    # (the API reads the clock a moment later: the window's running time, and the rate, move by a hair)
    assert {k: (v[0], v[2]) for k, v in got.items()} == {"gpu-a:101": (1, True), "gpu-b:202": (1, True), "gpu-c:303": (1, False)}
    assert abs(got["gpu-a:101"][1] - ra) <= 0.11 and abs(got["gpu-b:202"][1] - rb) <= 0.11 and got["gpu-c:303"][1] == 0.0

    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="workers-table"' in page
    for name in ("gpu-a:101", "gpu-b:202", "gpu-c:303"):
        assert f'data-worker="{name}"' in page
    assert f"<td>{ra}</td>" in page or f"<td>{round(ra + 0.1, 1)}</td>" in page or f"<td>{round(ra - 0.1, 1)}</td>" in page


def test_open_file_limit_is_raised_to_the_hard_limit_and_a_short_one_is_reported():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256) if hard == resource.RLIM_INFINITY else min(hard, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        after_soft, after_hard = fdlimit.raise_open_file_limit()
        assert after_hard == hard
        assert after_soft == (hard if hard != resource.RLIM_INFINITY else after_soft) and after_soft > lowered
        assert fdlimit.check_open_file_limit(16_384 if after_soft >= 16_384 + fdlimit.FD_HEADROOM else 1) is None
        too_many = after_soft  # parallelism + headroom above the limit
        msg = fdlimit.check_open_file_limit(too_many)
        assert msg is not None and f"open-file limit {after_soft}" in msg and "ulimit -Hn" in msg
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
