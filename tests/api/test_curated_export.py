"""Curated export (GET /api/jobs/<id>/export/ with filters): a reward range, tasks whose rewards are all equal left
out, a version-lag bound and failure classes, on both export paths (PostgreSQL's jsonb text for ok rows, the
generic one for ?which=all)."""
from __future__ import annotations

import json

import pytest
from django.utils import timezone

from controlplane.endpoints.models import WeightVersion
from controlplane.jobs.models import Rollout
from tests.factories import make_job

# 4 tasks x 4 repeats: task 0 always 1.0, task 1 never, task 2 half, task 3 0.25 steps (its last row failed)
REWARDS = {0: [1.0] * 4, 1: [0.0] * 4, 2: [1.0, 0.0, 1.0, 0.0], 3: [0.0, 0.25, 0.5, 0.75]}


@pytest.fixture
def job(alice, dataset, endpoint):
    return make_job(alice, dataset, endpoint, n_rollouts=16, repeats=4, fail_every=16,
                    rewards=lambda task, rep: REWARDS[task][rep])


def _export(api, job, **params):
    r = api.get(f"/api/jobs/{job.pk}/export/", params)
    assert r.status_code == 200, r.content
    rows = [json.loads(x) for x in b"".join(r.streaming_content).decode().splitlines()]
    return [(x["_ng_task_index"], x["_ng_rollout_index"]) for x in rows]


@pytest.mark.parametrize("which", ["ok", "all"])
def test_reward_range_and_all_equal_tasks(api, job, which):
    assert _export(api, job, which=which, reward_min=0.25, reward_max=0.75) == [(3, 1), (3, 2)]
    got = _export(api, job, which=which, skip_equal="true")
    assert got == [(2, 0), (2, 1), (2, 2), (2, 3), (3, 0), (3, 1), (3, 2)] + ([(3, 3)] if which == "all" else [])
    assert len(_export(api, job, which=which)) == (15 if which == "ok" else 16)  # no filter: all of them


def test_lag_bound_leaves_out_old_versions_and_marked_rows(api, job):
    now = timezone.now()
    for n in (1, 2):
        WeightVersion.objects.create(endpoint=job.endpoint, version=str(n), previous_version=str(n - 1),
                                     trace_id=f"t{n}", started_at=now, applied_at=now)
    Rollout.objects.filter(job=job, task_index__lt=2).update(weight_version="1")
    Rollout.objects.filter(job=job, task_index__gte=2).update(weight_version="2")
    Rollout.objects.filter(job=job, task_index=2, rollout_index=0).update(stale=True)
    assert _export(api, job, max_lag=0) == [(2, 1), (2, 2), (2, 3), (3, 0), (3, 1), (3, 2)]
    assert len(_export(api, job, max_lag=1)) == 15 - 1  # version 1 is within 1; the marked row is not


def test_failure_classes(api, job):
    assert _export(api, job, which="failed", failure_class="http_5xx,timeout") == []
    assert _export(api, job, which="failed", failure_class="http_429") == [(3, 3)]
    assert len(_export(api, job, which="all", failure_class="timeout")) == 15  # ok rows are not affected


def test_bad_filters_are_400(api, job):
    for bad in ({"reward_min": "nan"}, {"max_lag": -1}, {"failure_class": "A B"}, {"skip_equal": "maybe"}):
        assert api.get(f"/api/jobs/{job.pk}/export/", bad).status_code == 400, bad
