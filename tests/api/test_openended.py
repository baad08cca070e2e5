"""Open-ended collection from the user's seat (POST /api/jobs/ with `open_ended`, the rollout stream, .../stop/,
.../cancel/), against the simulator; the chunks run through the workers' own code path (runtime.run_chunk, what
the Celery task calls): it keeps collecting past one pass with fresh repeat indices, holds at most the stated
bound ahead of a consumer that does not acknowledge and resumes when it does, shows buffer fill and consumption
rate as the stored rows have them, and stops (gracefully or by cancel) with every rollout stored once."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection
from django.db.models import Count
from django.test import Client
from django.urls import reverse

from controlplane.jobs.models import CollectionJob, JobChunk, Rollout, StreamConsumer
from controlplane.jobs.openended import _order
from controlplane.jobs.runtime import run_chunk
from tests.factories import ingest_dataset, make_endpoint

from .conftest import _client

pytestmark = pytest.mark.django_db(transaction=True)


def _create(api, dataset, endpoint, **kw):
    body = {
        "dataset": dataset.pk,
        "endpoint": endpoint.pk,
        "num_samples_in_parallel": 4,
        "responses_create_params": {"max_output_tokens": 8},
        **kw,
    }
    r = api.post("/api/jobs/", body, format="json")
    assert r.status_code == 201, r.content
    job = CollectionJob.objects.get(pk=r.json()["id"])
    rows = sum(c.end_row - c.start_row for c in JobChunk.objects.filter(job=job))
    assert r.json()["progress"]["total"] == rows * job.num_repeats == job.total_rollouts  # the chunks made so far
    return job


def _work(job, max_runs=200):
    """A worker: run the job's pending chunks (and those the runs add) until none is pending."""
    runs = 0
    while runs < max_runs:
        job.refresh_from_db(fields=["state"])
        if job.state not in ("queued", "running"):  # workers skip its chunks
            return runs
        pending = list(JobChunk.objects.filter(job=job, state="pending").order_by("index").values_list("pk", flat=True))
        if not pending:
            return runs
        for pk in pending:
            assert run_chunk(pk, "test-worker", redispatch=False) in ("done", "skipped", "cancelled")
            runs += 1
    raise AssertionError("the job never stopped adding chunks")


def _take(api, job, consumer="trainer", **params):
    r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": consumer, **params})
    assert r.status_code == 200, r.content
    return r.json()


def _ack(api, job, batch, consumer="trainer"):
    r = api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": consumer, "token": batch["token"]}, format="json")
    assert r.status_code == 200, r.content
    return r.json()


def _detail(api, job):
    r = api.get(f"/api/jobs/{job.pk}/")
    assert r.status_code == 200
    return r.json()


def _ahead(job, consumer="trainer"):
    cursor = StreamConsumer.objects.filter(job=job, name=consumer).values_list("cursor", flat=True).first() or 0
    return Rollout.objects.filter(job=job, pk__gt=cursor).count()


def _unique(job):
    return (
        not Rollout.objects.filter(job=job)
        .values("task_index", "rollout_index")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .exists()
    )


@pytest.fixture
def sim(simulator_factory):
    return simulator_factory(seed=3, ttft_ms=1, itl_ms=0, jitter=0)


@pytest.mark.slow
def test_keeps_collecting_bounded_by_the_consumer_then_stops_with_every_rollout_once(alice, sim):
    api = _client(alice)
    dataset = ingest_dataset(alice, n=6)
    endpoint = make_endpoint(alice, sim.url, model=sim.model, name="sim-oe")
    # R = 2, buffer 7: chunks of min(chunk_size 2, 7 // 2) = 2 rows -> C = 4 rollouts; bound 7 + 4 - 1 = 10
    job = _create(api, dataset, endpoint, num_repeats=2, chunk_size=2, open_ended={"buffer": 7, "consumer": "trainer"})
    detail = _detail(api, job)
    oe = detail["open_ended"]
    assert (oe["buffer"], oe["chunk_rollouts"], oe["bound"], oe["stored"], oe["pass_index"]) == (7, 4, 10, 0, 0)
    assert detail["progress"]["total"] == 8  # the rollouts of the chunks made so far (two of 4)

    # (2) a consumer that does not acknowledge: collection stops growing at the buffer (within the bound)
    _work(job)
    stored = Rollout.objects.filter(job=job).count()
    assert 7 <= stored <= 10, stored
    assert _work(job) == 0 and Rollout.objects.filter(job=job).count() == stored  # nothing more is started
    job.refresh_from_db()
    assert job.state == "running" and not job.stalled
    taken = _take(api, job, max=3)  # taken, never acknowledged: still in the buffer
    assert taken["count"] == 3 and _work(job) == 0

    # (1) + resume: the consumer acknowledges, collection resumes, pass after pass, never past the bound
    seen, max_ahead = [], _ahead(job)
    while Rollout.objects.filter(job=job).count() < 30:
        b = _take(api, job, max=3)
        assert b["count"], "the stream ran dry while the job should collect more"
        _ack(api, job, b)
        seen += [r["id"] for r in b["rollouts"]]
        _work(job)
        max_ahead = max(max_ahead, _ahead(job))
    assert max_ahead <= 10
    job.refresh_from_db()
    stride = job.open_ended["stride"]
    assert stride == 2  # every row once in the dataset: 1 occurrence x R
    passes = {}
    for t, r in Rollout.objects.filter(job=job).values_list("task_index", "rollout_index"):
        passes.setdefault(r // stride, set()).add(t)
    assert len(passes) >= 3 and passes[0] == passes[1] == set(range(6))  # past one pass, every row each pass
    assert _unique(job)

    # (3) the API's and the page's figures are the stored rows'
    oe = _detail(api, job)["open_ended"]
    consumer = StreamConsumer.objects.get(job=job, name="trainer")
    assert oe["stored"] == Rollout.objects.filter(job=job).count()
    assert oe["unconsumed"] == Rollout.objects.filter(job=job, pk__gt=consumer.cursor).count() == _ahead(job)
    assert oe["consumed"] == Rollout.objects.filter(job=job, pk__lte=consumer.cursor).count()
    assert oe["acked"] == len(seen) == consumer.delivered
    assert oe["fill"] == round(oe["unconsumed"] / 7, 4)
    assert oe["acked_recent"] == len(seen)  # every ack in the last minute
    assert oe["consumption_per_s"] == round(len(seen) / oe["window_s"], 3) and oe["consumption_per_s"] > 0
    assert oe["pass_index"] == max(passes)
    page = Client()
    page.force_login(alice)
    html = page.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert 'id="open-ended"' in html
    assert f'<td id="oe-unconsumed">{oe["unconsumed"]}</td>' in html
    assert f'<td id="oe-consumed">{oe["consumed"]}</td>' in html
    assert f"({oe['acked_recent']})</td>" in html  # the rate's acknowledged rollouts (its window moves on)
    assert 'id="action-stop"' in html

    # (4) stop: the chunks in flight finish, none is added (not even when the consumer acknowledges), it completes
    b = _take(api, job, max=3)
    _ack(api, job, b)  # room: the next chunk is made
    seen += [r["id"] for r in b["rollouts"]]
    chunks = JobChunk.objects.filter(job=job).count()
    assert JobChunk.objects.filter(job=job).exclude(state="done").exists()
    r = api.post(f"/api/jobs/{job.pk}/stop/")
    assert r.status_code == 200 and r.json()["open_ended"]["stopping"] and r.json()["state"] == "running"
    while (b := _take(api, job, max=5))["count"]:
        _ack(api, job, b)
        seen += [r["id"] for r in b["rollouts"]]
    _work(job)
    job.refresh_from_db()
    assert job.state == "completed" and JobChunk.objects.filter(job=job).count() == chunks
    assert job.completed_count + job.failed_count == Rollout.objects.filter(job=job).count() == job.total_rollouts
    while (b := _take(api, job, max=5))["count"]:
        _ack(api, job, b)
        seen += [r["id"] for r in b["rollouts"]]
    ok = sorted(Rollout.objects.filter(job=job, status="ok").values_list("id", flat=True))
    assert sorted(seen) == ok and len(seen) == len(set(seen)) and _unique(job)  # every rollout handed out once
    assert api.post(f"/api/jobs/{job.pk}/stop/").status_code == 409  # over


@pytest.mark.slow
def test_cancel_mid_chunk_loses_nothing_and_adds_nothing(alice, simulator_factory):
    sim = simulator_factory(seed=4, ttft_ms=500, itl_ms=0, jitter=0)
    api = _client(alice)
    dataset = ingest_dataset(alice, n=16)
    endpoint = make_endpoint(alice, sim.url, model=sim.model, name="sim-oe-slow")
    job = _create(
        api, dataset, endpoint, num_repeats=1, chunk_size=16, num_samples_in_parallel=2, open_ended={"buffer": 16}
    )
    chunk = JobChunk.objects.get(job=job)
    box = {}

    def worker():
        try:
            box["outcome"] = run_chunk(chunk.pk, "test-worker", redispatch=False)
        finally:
            connection.close()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while Rollout.objects.filter(job=job).count() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.post(f"/api/jobs/{job.pk}/cancel/").status_code == 200
    thread.join(30)
    assert box.get("outcome") == "cancelled"
    stored = Rollout.objects.filter(job=job).count()
    assert 2 <= stored < 16 and _unique(job)
    seen = []
    while (b := _take(api, job, max=3))["count"]:
        _ack(api, job, b)  # acknowledgements after the cancel start nothing
        seen += [r["id"] for r in b["rollouts"]]
    assert JobChunk.objects.filter(job=job).count() == 1 and _work(job) == 0
    assert sorted(seen) == sorted(Rollout.objects.filter(job=job, status="ok").values_list("id", flat=True))
    # resumed, it finishes the chunk (only the missing pairs) and goes on
    assert api.post(f"/api/jobs/{job.pk}/resume/").status_code == 200
    _work(job)
    assert _unique(job) and set(
        Rollout.objects.filter(job=job, rollout_index=0).values_list("task_index", flat=True)
    ) == set(range(16))


def test_shuffled_passes_follow_the_seed_and_cover_every_row(alice, sim):
    api = _client(alice)
    dataset = ingest_dataset(alice, n=6)
    endpoint = make_endpoint(alice, sim.url, model=sim.model, name="sim-oe-shuffle")
    job = _create(
        api, dataset, endpoint, num_repeats=1, chunk_size=2, open_ended={"buffer": 12, "shuffle": True, "seed": 7}
    )
    _work(job)
    assert Rollout.objects.filter(job=job).count() == 12  # two passes of 6 rows
    orders = []
    for p in (0, 1):
        order = []
        for c in JobChunk.objects.filter(job=job, pass_index=p).order_by("start_row"):
            got = set(
                Rollout.objects.filter(job=job, rollout_index=p)
                .filter(task_index__in=_order(6, 7, p)[c.start_row : c.end_row])
                .values_list("task_index", flat=True)
            )
            assert got == set(_order(6, 7, p)[c.start_row : c.end_row])
            order += list(_order(6, 7, p)[c.start_row : c.end_row])
        assert sorted(order) == list(range(6))
        orders.append(order)
    assert orders[0] != orders[1] != list(range(6))


def test_open_ended_options_are_validated_and_documented(api, alice, dataset, endpoint):
    for bad in (
        {"buffer": 0},
        {},
        {"buffer": 5, "seed": -1},
        {"buffer": 5, "consumer": "a b"},
        {"buffer": 5, "shuffle": "yes"},
        {"buffer": 5, "extra": 1},
        5,
    ):
        r = api.post("/api/jobs/", {"dataset": dataset.pk, "endpoint": endpoint.pk, "open_ended": bad}, format="json")
        assert r.status_code == 400 and "open_ended" in r.json(), (bad, r.content)
    # a job of one pass cannot be stopped (cancel it)
    r = api.post("/api/jobs/", {"dataset": dataset.pk, "endpoint": endpoint.pk}, format="json")
    assert r.json()["open_ended"] is None
    assert api.post(f"/api/jobs/{r.json()['id']}/stop/").status_code == 409
    schema = api.get("/api/schema/", {"format": "json"}).json()
    figures = schema["components"]["schemas"]["OpenEndedFigures"]["properties"]
    assert {"unconsumed", "fill", "consumption_per_s", "bound", "buffer"} <= set(figures)
    assert "open_ended" in schema["components"]["schemas"]["JobCreate"]["properties"]
    assert any(p.endswith("/stop/") for p in schema["paths"])


@pytest.mark.slow
def test_the_watchdog_leaves_a_job_waiting_for_its_consumer_running(alice, sim):
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.jobs.runtime import watchdog

    api = _client(alice)
    dataset = ingest_dataset(alice, n=6)
    endpoint = make_endpoint(alice, sim.url, model=sim.model, name="sim-oe-watchdog")
    job = _create(api, dataset, endpoint, chunk_size=2, open_ended={"buffer": 4})
    _work(job)
    stored = Rollout.objects.filter(job=job).count()
    report = watchdog(now=timezone.now() + timedelta(hours=1), dispatch=False, broker_lost=False)
    job.refresh_from_db()
    assert job.pk not in report["stalled"] + report["finalized"]
    assert job.state == "running" and not job.stalled and _work(job) == 0
    assert Rollout.objects.filter(job=job).count() == stored == 4
    # an acknowledgement whose top-up was lost (the cursor moved behind its back): the watchdog tops up
    StreamConsumer.objects.create(job=job, name="trainer", cursor=Rollout.objects.filter(job=job).order_by("-pk")[0].pk)
    watchdog(dispatch=False, broker_lost=False)
    assert _work(job) > 0 and Rollout.objects.filter(job=job).count() == 8
    # the page's Stop button: nothing in flight (the buffer is full), so it completes at once
    page = Client()
    page.force_login(alice)
    assert page.post(reverse("dashboard:job_action", args=[job.pk, "stop"])).status_code == 302
    job.refresh_from_db()
    assert job.state == "completed" and job.open_ended["stopping"]
    assert 'id="action-stop"' not in page.get(reverse("dashboard:job", args=[job.pk])).content.decode()


def test_recollect_past_the_lag_bound_reopens_the_right_pass_and_position(alice, sim):
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.endpoints.models import WeightVersion

    api = _client(alice)
    dataset = ingest_dataset(alice, n=6)
    endpoint = make_endpoint(alice, sim.url, model=sim.model, name="sim-oe-recollect")
    job = _create(
        api,
        dataset,
        endpoint,
        chunk_size=2,
        max_version_lag=0,
        stale_policy="recollect",
        open_ended={"buffer": 12, "shuffle": True, "seed": 11},
    )
    _work(job)
    before = set(Rollout.objects.filter(job=job).values_list("task_index", "rollout_index"))
    assert len(before) == 12  # two shuffled passes
    # a weight update; two rollouts (one per pass, each in a chunk other than the one at its task's own row
    # position) are left one version behind, past max_version_lag 0
    now = timezone.now()
    WeightVersion.objects.create(
        endpoint=endpoint,
        version="1",
        previous_version="0",
        trace_id="t1",
        started_at=now - timedelta(seconds=2),
        applied_at=now - timedelta(seconds=1),
    )
    behind = [next((t, p) for t in range(6) if _order(6, 11, p).index(t) // 2 != t // 2) for p in (0, 1)]
    Rollout.objects.filter(job=job).update(weight_version="1")
    for t, p in behind:
        Rollout.objects.filter(job=job, task_index=t, rollout_index=p).update(weight_version="0")
    b = _take(api, job, max=20)
    assert b["count"] == 10 and b["skipped_stale"] == 2  # the two deleted, their chunks reopened
    reopened = {(c.pass_index, c.start_row) for c in JobChunk.objects.filter(job=job, state="pending")}
    assert reopened == {(p, _order(6, 11, p).index(t) // 2 * 2) for t, p in behind}
    _work(job)
    after = set(Rollout.objects.filter(job=job).values_list("task_index", "rollout_index"))
    assert after == before and _unique(job)  # collected again, in their own pass and position
    assert set(Rollout.objects.filter(job=job, weight_version="0").values_list("task_index", "rollout_index")) <= set(
        behind
    )


def test_failed_rollouts_do_not_hold_the_buffer_for_good(alice, simulator_factory):
    sim = simulator_factory(seed=6, ttft_ms=1, itl_ms=0, jitter=0, fault_rates={"500": 1.0})
    api = _client(alice)
    dataset = ingest_dataset(alice, n=6)
    endpoint = make_endpoint(alice, sim.url, model=sim.model, name="sim-oe-failing", max_retries=0)
    job = _create(api, dataset, endpoint, chunk_size=2, open_ended={"buffer": 4})
    _work(job)
    assert Rollout.objects.filter(job=job, status="failed").count() == 4 == Rollout.objects.filter(job=job).count()
    assert _work(job) == 0  # the buffer is full of failures
    sim.configure(fault_rates={})  # the server recovers
    b = _take(api, job, max=3)  # nothing to hand out, but the consumer's cursor passes the failures ...
    assert b["count"] == 0 and _ahead(job) == 0
    assert _work(job) > 0  # ... and collection goes on
    b = _take(api, job, max=10)
    assert b["count"] == 4 and {r["status"] for r in b["rollouts"]} == {"ok"}


def test_another_user_can_neither_stop_nor_see_an_open_ended_job(alice, bob, sim):
    """A second account: stop, the stream and the job are 404 (not 403: not even its existence shows)."""
    job = _create(_client(alice), ingest_dataset(alice, n=4), make_endpoint(alice, sim.url, model=sim.model, name="sim-o2"),
                  open_ended={"buffer": 4, "consumer": "trainer"})
    mallory = _client(bob)
    assert mallory.post(f"/api/jobs/{job.pk}/stop/").status_code == 404
    assert mallory.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "trainer"}).status_code == 404
    assert mallory.get(f"/api/jobs/{job.pk}/").status_code == 404
    job.refresh_from_db()
    assert job.open_ended["stopping"] is False and job.state == "queued"  # untouched (no worker here)
