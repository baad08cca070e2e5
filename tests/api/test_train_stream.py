"""The rollout stream for trainers (GET /api/jobs/<id>/stream/, POST .../stream/ack/): exactly once per named
consumer across its restarts, complete groups, all-equal groups left out, bounded staleness, ownership."""
from __future__ import annotations

import pytest
from datetime import timedelta

from django.utils import timezone

from controlplane.endpoints.models import WeightVersion
from controlplane.jobs.models import JobChunk, Rollout
from controlplane.limits import STREAM_MAX_BATCH
from tests.factories import make_job

from .conftest import _client


def _take(api, job, consumer="trainer", **params):
    r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": consumer, **params})
    assert r.status_code == 200, r.content
    return r.json()


def _ack(api, job, batch, consumer="trainer"):
    r = api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": consumer, "token": batch["token"]}, format="json")
    assert r.status_code == 200, r.content
    return r.json()


def _ids(batch):
    return [r["id"] for r in batch["rollouts"]]


def test_exactly_once_with_a_consumer_killed_between_take_and_ack(alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=50, state="running", fail_every=10)
    ok_ids = sorted(Rollout.objects.filter(job=job, status="ok").values_list("id", flat=True))
    seen = []
    first = _take(_client(alice), job, max=7)
    assert first["count"] == 7 and not first["redelivered"] and first["token"]
    # the trainer dies before acknowledging; a new process (new client, same consumer name) takes again
    again = _take(_client(alice), job, max=7)
    assert again["redelivered"] and _ids(again) == _ids(first) and again["token"] == first["token"]
    out = _ack(_client(alice), job, again)
    assert out["acked"] == 7 and out["delivered"] == 7
    assert _ack(_client(alice), job, again)["acked"] == 0  # a retried ack is a no-op
    seen += _ids(again)
    # new rows land while the trainer consumes
    from tests.factories import add_rollouts
    add_rollouts(job, 5, start_task=1000)
    ok_ids = sorted(Rollout.objects.filter(job=job, status="ok").values_list("id", flat=True))
    api = _client(alice)
    while True:
        b = _take(api, job, max=7)
        if not b["count"]:
            break
        if len(seen) % 2:  # every other batch: killed before the ack, taken again after the restart
            b2 = _take(_client(alice), job, max=7)
            assert _ids(b2) == _ids(b)
            b = b2
        _ack(api, job, b)
        seen += _ids(b)
    assert sorted(seen) == ok_ids and len(seen) == len(set(seen))  # every ok rollout once, none failed
    assert all(r.status == "ok" for r in Rollout.objects.filter(pk__in=seen))
    assert _take(api, job, max=7)["count"] == 0  # acked batches never come again
    consumers = api.get(f"/api/jobs/{job.pk}/stream/consumers/").json()["consumers"]
    assert consumers[0]["name"] == "trainer" and consumers[0]["delivered"] == len(ok_ids)


def test_an_ack_of_a_batch_that_is_not_pending_is_refused(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=4, state="running")
    r = api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": "t", "token": "abc"}, format="json")
    assert r.status_code == 409
    _take(api, job, consumer="t", max=2)
    r = api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": "t", "token": "abc"}, format="json")
    assert r.status_code == 409


def test_complete_groups_only_and_all_equal_groups_left_out(api, alice, dataset, endpoint):
    # 10 tasks x 4 repeats; tasks 0-4 have varied rewards, tasks 5-9 all equal
    job = make_job(alice, dataset, endpoint, n_rollouts=40, repeats=4, state="running",
                   rewards=lambda task, rep: float(rep % 2) if task < 5 else 1.0)
    missing = Rollout.objects.get(job=job, task_index=2, rollout_index=3)
    data = missing.data
    missing.delete()  # task 2 is incomplete for now
    got = []
    while True:
        b = _take(api, job, consumer="grpo", max=8, groups="true", skip_equal="true")
        if not b["count"]:
            break
        assert b["count"] <= 8 and b["count"] % 4 == 0
        got.append(b)
        _ack(api, job, b, consumer="grpo")
    rows = [r for b in got for r in b["rollouts"]]
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task_index"], []).append(r["rollout_index"])
    assert by_task == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3]}
    assert sum(b["skipped_equal"] for b in got) == 5
    # the missing repeat lands: the group is handed out then, whole, once
    Rollout.objects.create(job=job, task_index=2, rollout_index=3, status="ok", reward=1.0, data=data)
    b = _take(api, job, consumer="grpo", max=8, groups="true", skip_equal="true")
    assert [(r["task_index"], r["rollout_index"]) for r in b["rollouts"]] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    _ack(api, job, b, consumer="grpo")
    assert _take(api, job, consumer="grpo", max=8, groups="true", skip_equal="true")["count"] == 0
    # a consumer's mode is fixed
    r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "grpo", "max": 8})
    assert r.status_code == 409


def test_another_users_job_is_404(bob_api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=4, state="running")
    assert bob_api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "t"}).status_code == 404
    assert bob_api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": "t", "token": "ab"},
                        format="json").status_code == 404
    assert bob_api.get(f"/api/jobs/{job.pk}/stream/consumers/").status_code == 404


def test_inputs_are_validated(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=4, state="running")
    for bad in ({}, {"consumer": ""}, {"consumer": "a b"}, {"consumer": "t", "max": 0}, {"consumer": "t", "wait": -1},
                {"consumer": "t", "wait": 31}, {"consumer": "t", "max": STREAM_MAX_BATCH + 1}, {"consumer": "t", "wait": "nan"}):
        assert api.get(f"/api/jobs/{job.pk}/stream/", bad).status_code == 400, bad
    assert api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": "t", "token": 5}, format="json").status_code == 400


def _versions(endpoint, n):
    now = timezone.now()
    for v in range(1, n + 1):
        WeightVersion.objects.create(endpoint=endpoint, version=str(v), previous_version=str(v - 1), trace_id=f"t{v}",
                                     started_at=now - timedelta(seconds=100 - v), applied_at=now - timedelta(seconds=99 - v))


@pytest.mark.slow
def test_rollouts_past_the_lag_bound_are_kept_and_marked(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=40, state="running")
    job.max_version_lag, job.stale_policy = 1, "mark"
    job.save()
    for i, r in enumerate(Rollout.objects.filter(job=job).order_by("id")):
        Rollout.objects.filter(pk=r.pk).update(weight_version=str(i % 4))  # versions 0..3, 10 rows each
    _versions(endpoint, 3)  # current 3: lag 3, 2, 1, 0
    before = api.get(f"/api/jobs/{job.pk}/weight-versions/").json()
    assert before["max_version_lag"] == 1 and before["past_bound"] == 20
    rows = []
    while (b := _take(api, job, max=6))["count"]:
        rows += b["rollouts"]
        _ack(api, job, b)
    assert len(rows) == 20 and {r["weight_version"] for r in rows} == {"2", "3"} and max(r["lag"] for r in rows) <= 1
    assert Rollout.objects.filter(job=job, stale=True).count() == 20  # kept, marked
    out = api.get(f"/api/jobs/{job.pk}/weight-versions/").json()
    per = {v["version"]: v for v in out["versions"]}
    assert per["0"]["stale_marked"] == 10 and per["1"]["stale_marked"] == 10 and per["2"]["stale_marked"] == 0
    assert per["0"]["past_bound"] and not per["2"]["past_bound"] and out["stale_marked"] == 20
    page = _page(alice, job)
    assert "bounded staleness: lag ≤ 1" in page and "marked stale 20" in page


def _page(user, job):
    from django.test import Client

    c = Client()
    c.force_login(user)
    return c.get(f"/jobs/{job.pk}/").content.decode()


def test_rollouts_past_the_lag_bound_are_collected_again(api, alice, dataset, endpoint, settings):
    from controlplane.jobs import services

    job = services.create_job(owner=alice, dataset=dataset, endpoint=endpoint, launch=False, max_version_lag=0,
                              stale_policy="recollect")
    n = dataset.row_count
    Rollout.objects.bulk_create([Rollout(job=job, task_index=i, rollout_index=0, status="ok", reward=1.0, data={},
                                         weight_version="1" if i < 2 else "2") for i in range(n)])
    JobChunk.objects.filter(job=job).update(state="done")
    job.state = "completed"
    job.save()
    _versions(endpoint, 2)
    b = _take(api, job, max=100)
    assert b["skipped_stale"] == 2 and {r["task_index"] for r in b["rollouts"]} == set(range(2, n))
    job.refresh_from_db()
    assert job.state == "queued" and job.completed_count == n - 2  # reopened: tasks 0 and 1 are collected again
    assert not Rollout.objects.filter(job=job, task_index__lt=2).exists()
    assert JobChunk.objects.filter(job=job, state="pending").exists()


def test_job_options_for_staleness(api, dataset, endpoint):
    r = api.post("/api/jobs/", {"dataset": dataset.pk, "endpoint": endpoint.pk, "max_version_lag": 2,
                                "stale_policy": "recollect"}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["max_version_lag"] == 2 and r.json()["stale_policy"] == "recollect"
    bad = api.post("/api/jobs/", {"dataset": dataset.pk, "endpoint": endpoint.pk, "max_version_lag": -1},
                   format="json")
    assert bad.status_code == 400


def test_a_take_can_acknowledge_the_batch_before(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=10, state="running")
    a = _take(api, job, max=4)
    b = _take(api, job, max=4, ack=a["token"])
    assert not b["redelivered"] and set(_ids(a)).isdisjoint(_ids(b))
    again = _take(api, job, max=4, ack=a["token"])  # a retried request: the ack is a no-op, b comes again
    assert again["redelivered"] and _ids(again) == _ids(b)
    assert api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "trainer", "ack": "ffff"}).status_code == 409
