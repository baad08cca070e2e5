"""The endpoint's per-replica load: the latest tick of every run in the window, summed per replica."""
from __future__ import annotations

import time
from datetime import datetime, timedelta

from django.utils import timezone

from controlplane.jobs.replica_load import replica_load
from controlplane.jobs.models import JobMetricSample
from tests.factories import make_endpoint, service_job


def _tick(job, worker, t, reps):
    return JobMetricSample.objects.create(job=job, worker=worker, t=t, extra={"replicas": reps})


def _rep(url, state="in", since=0.0, **kw):
    return {"url": url, "state": state, "since": since, "reason": kw.pop("reason", ""), "in_flight": 0, "requests": 0,
            "ok": 0, "errors": 0, "times_out": 0, "last_error": "", **kw}


def test_runs_add_up_out_wins_and_old_ticks_are_ignored(user):
    a, b = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
    ep = make_endpoint(user, a + "/v1", replica_urls=[b])
    job = service_job(user, endpoint=ep)
    now = timezone.now()
    t_out = time.time() - 20
    # run 1: an older tick (superseded) and its latest one
    _tick(job, "w1 chunk 0", now - timedelta(seconds=5), [_rep(a, requests=1), _rep(b, requests=1)])
    _tick(job, "w1 chunk 0", now - timedelta(seconds=1), [
        _rep(a, in_flight=3, requests=40, ok=38, errors=2), _rep(b, "out", t_out, reason="cannot connect", requests=4, errors=4)])
    # run 2 still has b in rotation
    _tick(job, "w2 chunk 1", now - timedelta(seconds=2), [
        _rep(a, in_flight=5, requests=60, ok=60), _rep(b, "in", t_out - 100, requests=20, ok=20)])
    # a run that ended long ago: outside the window
    _tick(job, "w3 chunk 2", now - timedelta(seconds=300), [_rep(a, requests=999), _rep(b, requests=999)])

    load = replica_load(ep, window_s=30)
    by = {r["url"]: r for r in load["replicas"]}
    assert load["runs"] == 2 and load["in_rotation"] == 1
    assert by[a]["in_flight"] == 8 and by[a]["requests"] == 100 and by[a]["errors"] == 2
    assert by[a]["state"] == "in" and by[a]["error_rate"] == 0.02 and by[a]["share"] == round(100 / 124, 4)
    assert by[b]["state"] == "out" and by[b]["reason"] == "cannot connect" and by[b]["requests"] == 24
    assert abs(datetime.fromisoformat(by[b]["since"]).timestamp() - t_out) < 0.01  # when the first run took it out


def test_no_run_in_the_window_is_idle_with_the_last_health_check(user):
    ep = make_endpoint(user, "http://127.0.0.1:8001", replica_urls=["http://127.0.0.1:8002"],
                       last_health={"ok": False, "checked_at": "2026-11-23T00:00:00+00:00", "replicas": [
                           {"url": "http://127.0.0.1:8001", "ok": True, "latency_ms": 3.0},
                           {"url": "http://127.0.0.1:8002", "ok": False, "error": "connection refused"}]})
    load = replica_load(ep)
    assert load["runs"] == 0 and [r["state"] for r in load["replicas"]] == ["idle", "idle"]
    assert load["replicas"][1]["health"] == {"ok": False, "error": "connection refused"}
    assert load["replicas"][0]["requests"] == 0 and load["replicas"][0]["share"] is None


def test_single_url_endpoint_counts_every_job_and_stopped_runs_hold_nothing(user, client):
    from controlplane.jobs.replica_load import run_health

    a = "http://127.0.0.1:8001"
    ep = make_endpoint(user, a)  # one URL: its runs' tables are the endpoint's
    job1, job2 = service_job(user, endpoint=ep), service_job(user, endpoint=ep)
    now = timezone.now()
    _tick(job1, "w1 chunk 0", now - timedelta(seconds=1), [_rep(a, in_flight=24, requests=300, ok=300)])
    _tick(job2, "w2 chunk 0", now - timedelta(seconds=2), [_rep(a, in_flight=8, requests=100, ok=100)])
    # a run paused 20 s ago: its last tick had 16 in flight; its counts stand, its slots are free
    _tick(job2, "w2 chunk 1", now - timedelta(seconds=20), [_rep(a, in_flight=16, requests=50, ok=50)])
    load = replica_load(ep, window_s=30)
    (row,) = load["replicas"]
    assert load["runs"] == 3 and row["state"] == "in" and row["in_flight"] == 32 and row["requests"] == 450
    health = run_health(ep)
    assert health["ok"] and health["answered"] == 300
    client.force_login(user)
    html = client.get(f"/endpoints/{ep.pk}/").content.decode()
    assert "answering" in html and ">unknown<" not in html


def test_only_stopped_runs_are_idle(user):
    a = "http://127.0.0.1:8001"
    ep = make_endpoint(user, a)
    job = service_job(user, endpoint=ep)
    _tick(job, "w1 chunk 0", timezone.now() - timedelta(seconds=12), [_rep(a, in_flight=32, requests=90, ok=90)])
    (row,) = replica_load(ep, window_s=30)["replicas"]
    assert row["state"] == "idle" and row["in_flight"] == 0 and row["requests"] == 90


def test_a_resumed_run_of_the_same_series_adds_to_the_one_before(user):
    a = "http://127.0.0.1:8001"
    ep = make_endpoint(user, a)
    job = service_job(user, endpoint=ep)
    now = timezone.now()
    # the same worker ran chunk 0 before a pause (300 requests) and again after it (its counters from 0)
    JobMetricSample.objects.create(job=job, worker="w1 chunk 0", t=now - timedelta(seconds=20), elapsed_s=8.0,
                                   extra={"replicas": [_rep(a, in_flight=16, requests=300, ok=300)]})
    JobMetricSample.objects.create(job=job, worker="w1 chunk 0", t=now - timedelta(seconds=1), elapsed_s=3.0,
                                   extra={"replicas": [_rep(a, in_flight=16, requests=120, ok=120)]})
    load = replica_load(ep, window_s=30)
    (row,) = load["replicas"]
    assert load["runs"] == 2 and row["requests"] == 420 and row["in_flight"] == 16 and row["state"] == "in"
