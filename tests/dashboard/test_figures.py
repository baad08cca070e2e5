"""Each figure defined once (controlplane.jobs.figures) and the same wherever it is shown: rollouts stored,
running time with pauses excluded, average and recent rate. Runs one after another, runs before and after a
pause, and a killed worker's unstored results never inflate a figure."""
from __future__ import annotations

import gc
import os
import types

import pytest
from django.utils import timezone

from controlplane.dashboard.live import job_snapshot, metric_series
from controlplane.diagnostics.services import diagnose_job
from controlplane.jobs import figures
from controlplane.jobs.models import JobChunk, JobMetricSample, Rollout
from controlplane.jobs.workers import job_workers

from tests.factories import make_dataset, make_endpoint, make_job

pytestmark = pytest.mark.django_db

TD = timezone.timedelta


def _run(job, series, start, seconds, rate, now, *, worker="host1:100:celery:0", claimed=None, store=True):
    """A chunk run `start` s before now for `seconds` s at `rate`/s: a sample a second (cumulative counters as the
    run reports them, `claimed`/s if given: what a killed worker reported but never stored) and the rows it stored."""
    base = Rollout.objects.filter(job=job).count()
    stored = 0
    for k in range(1, seconds + 1):
        t = now - TD(seconds=start - k)
        n = int(rate * k) - stored
        if store and n:
            Rollout.objects.bulk_create([Rollout(job=job, task_index=base + stored + i, rollout_index=0, data={},
                                                 output_tokens=64, worker=worker, created_at=t) for i in range(n)])
            stored += n
        JobMetricSample.objects.create(job=job, worker=f"{worker} {series}", t=t, elapsed_s=float(k),
                                       completed=int((claimed or rate) * k), in_flight=8, parallelism=8,
                                       samples_per_s=(claimed or rate) * 3)  # a runner's noisy instant rate
    job.completed_count = Rollout.objects.filter(job=job).count()
    job.save(update_fields=["completed_count"])
    return stored


def _job(alice, state="running"):
    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=0, state=state)
    JobMetricSample.objects.filter(job=job).delete()
    job.total_rollouts = 100000
    job.save()
    return job


@pytest.mark.slow
def test_runs_one_after_another_do_not_add_their_rates(alice):
    job = _job(alice, state="completed")
    now = timezone.now()
    _run(job, "chunk 0", 100, 30, 40.0, now)  # 40/s for 30 s
    _run(job, "chunk 1", 70, 30, 40.0, now)  # then the next chunk, 40/s for 30 s
    assert figures.running_seconds(job) == pytest.approx(60, abs=2)
    assert figures.average_rate(job) == pytest.approx(40.0, rel=0.05)
    # the diagnosis's evidence: the same figures, not 80/s, and the stored count
    d = diagnose_job(job).to_dict()
    ev = {i["name"]: i["value"] for i in d["evidence_items"]}
    assert ev["throughput_rps"] == pytest.approx(40.0, rel=0.05)
    assert ev["rollouts"] == job.completed_count == 2400


def test_a_pause_is_not_running_time(alice):
    job = _job(alice, state="completed")
    now = timezone.now()
    _run(job, "chunk 0", 200, 20, 30.0, now)  # 20 s, then paused 120 s
    _run(job, "chunk 0", 60, 20, 30.0, now)  # resumed: the same series name, its counters from 0 again
    assert figures.running_seconds(job) == pytest.approx(40, abs=2)
    assert figures.average_rate(job) == pytest.approx(30.0, rel=0.05)
    snap = job_snapshot(job)
    assert snap["elapsed_s"] == pytest.approx(40, abs=2)
    assert snap["avg_samples_per_s"] == pytest.approx(30.0, rel=0.05)


def test_recent_rate_counts_stored_rows_over_running_time(alice):
    job = _job(alice)
    now = timezone.now()
    _run(job, "chunk 0", 300, 100, 20.0, now)  # ran long ago, then paused
    _run(job, "chunk 0", 4, 4, 20.0, now)  # resumed 4 s ago: 80 rows in 4 s of running
    rate = figures.recent_rate(job.pk, now)
    # not 80 / 10 s, not the runner's 60/s (within half a tick of when the run's first request went out: 4 s)
    assert rate.ok_per_s == pytest.approx(20.0, rel=0.15)
    assert rate.output_tokens_per_s == pytest.approx(20.0 * 64, rel=0.15)
    snap = job_snapshot(job, now)
    assert snap["samples_per_s"] == pytest.approx(20.0, rel=0.15) and snap["eta_s"] is not None


def test_chart_breaks_at_pauses_and_has_no_end_spike(alice):
    job = _job(alice, state="completed")
    now = timezone.now().replace(microsecond=500000)
    _run(job, "chunk 0", 100, 20, 25.0, now)
    _run(job, "chunk 0", 40, 20, 25.0, now)
    s = metric_series(job)
    gaps = [i for i, v in enumerate(s["samples_per_s"]) if v is None]
    assert len(gaps) == 2 and s["in_flight"][gaps[0]] is None  # a break at the pause ...
    assert gaps[1] == len(s["t"]) - 1  # ... and at the end: the job is not running
    values = [v for v in s["samples_per_s"] if v is not None]
    assert max(values) <= 25.0 * 1.1  # no start-up or end-of-run spike (the runner's instant rate said 75/s)
    assert values[-1] == pytest.approx(25.0, rel=0.1)


@pytest.mark.slow
def test_workers_panel_counts_only_stored_rollouts(alice):
    job = _job(alice)
    now = timezone.now()
    JobChunk.objects.create(job=job, index=0, start_row=0, end_row=10, state=JobChunk.State.RUNNING,
                            lease_owner="host1:100:celery:0#a", heartbeat_at=now)
    JobChunk.objects.create(job=job, index=1, start_row=10, end_row=20, state=JobChunk.State.RUNNING,
                            lease_owner="host2:200:celery:0#b", heartbeat_at=now - TD(seconds=600))
    # host2 was SIGKILLed: it reported 50/s but stored 10/s of it
    _run(job, "chunk 1", 130, 20, 10.0, now, worker="host2:200:celery:0", claimed=50.0)
    _run(job, "chunk 0", 30, 30, 40.0, now, worker="host1:100:celery:0")
    by = {w["worker"]: w for w in job_workers(job, now)}
    assert by["host2:200"]["rollouts"] == 200 and by["host2:200"]["rollouts_per_s"] == 0  # stored nothing lately
    assert not by["host2:200"]["alive"] and by["host2:200"]["in_flight"] == 0
    assert by["host1:100"]["rollouts"] == 1200
    assert by["host1:100"]["rollouts_per_s"] == pytest.approx(40.0, rel=0.1)
    assert by["host1:100"]["rollouts_per_s"] == pytest.approx(figures.recent_rate(job.pk, now).ok_per_s, rel=0.01)


def test_api_and_cli_show_the_same_figures(alice):
    from rest_framework.test import APIClient

    job = _job(alice, state="completed")
    now = timezone.now()
    _run(job, "chunk 0", 100, 30, 40.0, now)
    api = APIClient()
    api.force_authenticate(alice)
    body = api.get(f"/api/jobs/{job.pk}/").json()
    f = body["figures"]
    assert f["rollouts_stored"] == 1200 and f["running_s"] == pytest.approx(30, abs=1.5)
    assert f["average_rollouts_per_s"] == pytest.approx(40.0, rel=0.05)
    assert body["elapsed_s"] == pytest.approx(f["running_s"])
    from rolloutctl.cli import _rate_words

    import re

    words = _rate_words(body)  # what `rolloutctl wait` prints at the end
    assert float(re.search(r"([\d.]+) rollouts/s", words).group(1)) == pytest.approx(40.0, rel=0.05)
    assert "pauses excluded" in words


def test_a_failed_job_sends_its_reason_live_as_each_user_may_read_it(alice):
    import asyncio

    from django.contrib.auth import get_user_model

    from controlplane.dashboard.consumers import JobConsumer
    from controlplane.jobs.events import job_progress
    from workers.disclosure import MARK

    job = _job(alice)
    job.fail(f"cannot reach http://10.0.0.7:8000: connection refused after 5 retries{MARK}server said: secret banner")
    msg = job_progress(job)
    assert msg["state"] == "failed" and msg["error_message"].startswith("cannot reach")  # no reload needed
    sent = []

    async def deliver(user):
        c = JobConsumer()
        c.scope = {"user": user}

        async def send_json(content, close=False):
            sent.append(content)
        c.send_json = send_json
        await c.job_progress(dict(msg))

    staff = get_user_model().objects.create_user("ops", password="x", is_staff=True)
    asyncio.run(deliver(alice))
    asyncio.run(deliver(staff))
    assert "secret banner" not in sent[0]["error_message"] and "connection refused" in sent[0]["error_message"]
    assert "secret banner" in sent[1]["error_message"]


def _late_run(job, series, first_request, ticks, lead_s, *, busy=True):
    """A run whose first request went out at `first_request` and whose first tick came `lead_s` later (a loaded
    worker's late tick), then one a second, as the sink stores them (busy_s: none from an older worker)."""
    for k in range(ticks):
        JobMetricSample.objects.create(job=job, worker=series, t=first_request + TD(seconds=lead_s + k),
                                       elapsed_s=0.3 + lead_s + k, completed=k, in_flight=8, parallelism=8,
                                       extra={"busy_s": lead_s + k} if busy else {})


@pytest.mark.parametrize("vendor", ["postgresql", "sqlite"])
def test_a_late_first_tick_still_counts_the_run_from_its_first_request(alice, monkeypatch, vendor):
    from datetime import datetime, timezone as tz
    from types import SimpleNamespace

    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the PostgreSQL path needs PostgreSQL (the SQLite one runs on either)")
    if vendor == "sqlite":  # figures' Python path (SQLite's), on the same rows
        monkeypatch.setattr(figures, "connection", SimpleNamespace(vendor=vendor))
    job = _job(alice)
    base = datetime.fromtimestamp(timezone.now().timestamp() // 300 * 300 - 600, tz.utc)  # a cached prefix's cut
    at = lambda s: base + TD(seconds=s)  # noqa: E731
    _late_run(job, "w chunk 0", at(-60), 11, 2.0)  # before the cut: first tick 2 s late, then 10 s: 12 s
    _late_run(job, "w chunk 1", at(40), 6, 2.5)  # after a pause: 2.5 + 5 s
    _late_run(job, "w chunk 2", at(45.5), 3, 8.0)  # at work 8 s, but the job's last sample was 6 s before: 6 + 2 s
    _late_run(job, "w chunk 3", at(80), 3, 2.0, busy=False)  # no busy_s (older worker): half a tick, 0.5 + 2 s
    for _ in range(2):  # computed, then with the part before the cut from the cache
        assert figures.running_seconds(job, now=at(100)) == pytest.approx(30.0, abs=0.01)
    assert figures.running_seconds_many([job])[job.pk] == pytest.approx(30.0, abs=0.01)  # History
    # the recent window [45.5, 55.5]: chunk 1's last 2 s, then chunk 2 from the end of the silence: all 10 s
    assert figures._recent_span(job.pk, at(55.5)) == pytest.approx(10.0, abs=0.01)


def test_reading_the_samples_leaves_no_reference_cycles(alice):
    """A chunk run reads its job's samples every progress tick (live_figures -> _stamps): garbage in reference
    cycles there (a caught FieldError's traceback, reading "extra__busy_s", ~230 objects a read) waited for a full
    collection and grew the worker's heap with the job. Other threads of this process (the test runner's) may
    leave cycles of their own meanwhile, so the garbage is kept and looked at: none may come from the reads."""
    import django

    job = _job(alice)
    _late_run(job, "w chunk 0", timezone.now() - TD(seconds=20), 3, 2.0)
    qs = JobMetricSample.objects.filter(job_id=job.pk)
    figures._stamps(qs)  # first use: caches filled once
    gc.collect()
    ours = (os.path.dirname(django.__file__), figures.__file__)

    def from_the_reads(obj) -> bool:
        frame = obj.tb_frame if isinstance(obj, types.TracebackType) else obj
        if isinstance(frame, types.FrameType):
            return frame.f_code.co_filename.startswith(ours)
        return isinstance(obj, BaseException)

    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        reads = [figures._stamps(qs) for _ in range(10)]
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage if from_the_reads(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert [busy for _, _, busy in reads[-1]] == [2.0, 3.0, 4.0]
    assert found == []


def test_a_runs_last_rows_stored_after_its_last_busy_sample_count_as_running(alice):
    """The chart's rate at a second: ok rows of the window over its running seconds. A run's last answers are
    written after its last sample saw them in flight (batched writes; seconds late on a loaded machine): the
    second that stored them ran too, or a finished job's last point is over what the rows say (a browser test
    saw 39.3/s against 34.7/s)."""
    from tests.factories import add_rollouts

    job = _job(alice)
    s0 = int(timezone.now().timestamp()) - 60
    add_rollouts(job, 60)
    for k, pk in enumerate(Rollout.objects.filter(job=job).order_by("pk").values_list("pk", flat=True)):
        Rollout.objects.filter(pk=pk).update(created_at=_epoch(s0 + k // 10 + 0.5))  # 10 a second, s0..s0+5
    busy = set(range(s0, s0 + 5))  # requests in flight until s0+4; the rows of s0+5 written after
    rates, _ = figures.rate_series(job.pk, [s0 + 4, s0 + 5], busy)
    # ok rows (add_rollouts: all ok) over running seconds: 50 / 5 at s0+4, 60 / 6 at s0+5 (was 60 / 5)
    assert rates == [10.0, 10.0]
    # rows stored more than GAP_S after the last busy second do not make their seconds running ones
    early = s0 - 1 - int(figures.GAP_S)
    assert figures.rate_series(job.pk, [s0 + 5], {early})[0] == [60 / figures.MIN_SPAN_S]


def _epoch(s):
    from datetime import datetime, timezone as tz

    return datetime.fromtimestamp(s, tz.utc)
