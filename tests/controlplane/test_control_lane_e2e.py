"""The control lane with real processes: a control worker (`-Q <control>`) and a work worker whose every slot holds
a chunk. A trainer's weight updates go through the REST API: they start within the dispatch target while the
chunks run, two posted together run one at a time in posting order, a stale version is refused (409), `?wait`
answers when the update ends, and the trainer's trace id is on the action, in the operation log and in the
control worker's log."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
from rest_framework.test import APIClient

from controlplane.endpoints.models import AdminAction, AdminOperation, WeightVersion
from controlplane.jobs import services
from controlplane.jobs.models import JobChunk
from tests.factories import api_token
from tests.security.slow_servers import Worker, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


@pytest.fixture
def lanes(settings, tmp_path):
    """A work queue and a control queue of this test's own, and a worker for each (the default topology)."""
    tag = uuid.uuid4().hex[:8]
    work, control = f"lane-work-{tag}", f"lane-control-{tag}"
    settings.CELERY_TASK_ALWAYS_EAGER = False
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    settings.CELERY_TASK_DEFAULT_QUEUE, settings.CELERY_CONTROL_QUEUE = work, control
    env = {"CELERY_TASK_DEFAULT_QUEUE": work, "CELERY_CONTROL_QUEUE": control}
    workers = []

    def start(kind: str, concurrency: int) -> Worker:
        w = Worker(control if kind == "control" else work, tmp_path, concurrency=concurrency, **env)
        workers.append(w)
        wait_for(lambda: b" ready." in w.log_path.read_bytes(), 60, f"{kind} worker ready", w.tail)
        return w

    yield start, work, control
    for w in workers:
        w.stop()


def _api(user) -> APIClient:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {api_token(user)}")
    return c


def test_updates_skip_the_busy_chunks_run_in_order_and_carry_the_trainers_trace(
        lanes, user, math_dataset, sim_endpoint, simulator_factory):
    start, work, control = lanes
    sim = simulator_factory(update_weights_ms=200, ttft_ms=200, itl_ms=20)
    ep = sim_endpoint(sim.url, owner=user)
    worker = start("work", 2)
    control_worker = start("control", 2)
    # two jobs of many chunks keep both collection slots busy
    jobs = [services.create_job(owner=user, dataset=math_dataset(60, seed=i), endpoint=ep, num_repeats=8,
                                chunk_size=5, num_samples_in_parallel=4, launch=True) for i in range(2)]
    wait_for(lambda: JobChunk.objects.filter(job__in=jobs, state="running").count() >= 2, 60,
             "both work slots running a chunk", worker.tail)
    assert JobChunk.objects.filter(job__in=jobs, state="pending").count() > 10  # and many more chunks wait
    api = _api(user)
    url = f"/api/endpoints/{ep.pk}/weights/"

    # ?wait: the answer comes when the update has ended, with what the trainer waited
    trace = uuid.uuid4().hex
    t0 = time.monotonic()
    r = api.post(f"{url}?wait=30", {"checkpoint_id": "step-1"}, format="json", HTTP_X_TRACE_ID=trace)
    waited_ms = (time.monotonic() - t0) * 1000
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["state"] == "succeeded" and body["result"]["version"] == "1" and body["trace_id"] == trace
    assert body["dispatch_ms"] < 1000, body  # started while every work slot held a chunk
    assert 200 <= body["total_ms"] <= waited_ms + 50, (body, waited_ms)
    assert JobChunk.objects.filter(job__in=jobs, state="running").count() >= 2  # the chunks still run
    # the trainer's trace id: on every request to the server (operation log) and in the control worker's log
    ops = api.get(f"/api/endpoints/{ep.pk}/ops/log/?trace_id={trace}").json()["operations"]
    assert sorted(o["kind"] for o in ops) == ["pause", "resume", "update_weights"]
    assert AdminOperation.objects.filter(trace_id=trace).count() == 3
    assert trace in control_worker.tail(20000) and trace not in worker.tail(20000)

    # two updates posted together (versions given) run one at a time, in the order posted
    answers = {}

    def post(version):
        answers[version] = _api(user).post(f"{url}?wait=30", {"checkpoint_id": f"step-{version}",
                                                                "version": version}, format="json")

    first = threading.Thread(target=post, args=(5,))
    first.start()
    wait_for(lambda: AdminAction.objects.filter(params__version=5).exists(), 10, "the first update asked")
    second = threading.Thread(target=post, args=(6,))
    second.start()
    first.join(40), second.join(40)
    assert answers[5].status_code == 200 and answers[6].status_code == 200, answers
    a5, a6 = (AdminAction.objects.get(params__version=v) for v in (5, 6))
    assert a5.state == a6.state == "succeeded" and a5.pk < a6.pk
    assert a6.started_at >= a5.finished_at  # never overlapping
    assert list(WeightVersion.objects.filter(endpoint=ep).order_by("applied_at").values_list(
        "version", "previous_version")) == [("1", ""), ("5", "1"), ("6", "5")]
    assert sim.get_json("/weight_version")["weight_version"] == 6

    # a burst: four updates, then a health check. The updates wait for each other without holding a control slot,
    # so the health check starts at once: before the second of the updates still waiting when it was asked (the
    # third of the burst when the posts come quickly; under load the first updates may be done by then)
    burst = [api.post(url, {"checkpoint_id": f"burst-{i}"}, format="json").json()["id"] for i in range(4)]
    health = api.post(f"/api/endpoints/{ep.pk}/ops/health/", {}, format="json").json()["id"]
    wait_for(lambda: not AdminAction.objects.filter(pk__in=[*burst, health]).exclude(
        state__in=["succeeded", "failed"]).exists(), 30, "the burst ended", control_worker.tail)
    b = list(AdminAction.objects.filter(pk__in=burst).order_by("pk"))
    h = AdminAction.objects.get(pk=health)
    assert [a.state for a in b] == ["succeeded"] * 4 and h.state == "succeeded"
    assert [a.result["version"] for a in b] == ["7", "8", "9", "10"]
    assert all(later.started_at >= earlier.finished_at for earlier, later in zip(b, b[1:]))
    waiting = [a for a in b if a.started_at > h.created_at]
    if len(waiting) >= 2:
        assert h.started_at < waiting[1].started_at, (h.dispatch_ms, [a.dispatch_ms for a in b])
    assert h.dispatch_ms < 1000, h.dispatch_ms

    # a stale version is refused: 409, code stale_version, nothing queued
    n = AdminAction.objects.count()
    r = api.post(url, {"checkpoint_id": "old", "version": 4}, format="json")
    assert r.status_code == 409 and r.json()["code"] == "stale_version", r.content
    assert "stale version 4" in r.json()["detail"] and AdminAction.objects.count() == n
    # a malformed trace id is a 400
    r = api.post(url, {"checkpoint_id": "x"}, format="json", HTTP_X_TRACE_ID="not a trace\r\nid")
    assert r.status_code == 400, r.content

    # the stats: dispatch and total percentiles beside queue/rpc/wall
    stats = {s["kind"]: s for s in api.get(f"/api/endpoints/{ep.pk}/ops/stats/").json()["stats"]}
    upd = stats["update_weights"]
    assert upd["actions"] == 7 and upd["total_ms_p50"] >= 200 and stats["health"]["actions"] == 1
    # Prometheus: what the caller waited, from the control worker's process
    from prometheus_client import generate_latest

    from controlplane.monitoring.metrics import registry_for_scrape

    text = generate_latest(registry_for_scrape()).decode()
    assert 'controlplane_ops_action_seconds_count{kind="update_weights",phase="total"}' in text
    assert 'controlplane_ops_action_seconds_count{kind="update_weights",phase="dispatch"}' in text
    for job in jobs:
        services.cancel_job(job)
