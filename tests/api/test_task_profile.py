"""Per-task reward profile (GET /api/jobs/<id>/task-profile/, JSON and CSV): mean, variance, pass rate and range
per task over its ok rollouts, computed in the database; tasks with zero variance, always or never passed."""
from __future__ import annotations

import csv
import io
import statistics

import pytest

from tests.factories import make_job

# 4 tasks x 4 repeats: task 0 always 1.0, task 1 never, task 2 half, task 3 0.25 steps (with a failed row)
REWARDS = {0: [1.0] * 4, 1: [0.0] * 4, 2: [1.0, 0.0, 1.0, 0.0], 3: [0.0, 0.25, 0.5, 0.75]}


@pytest.fixture
def job(alice, dataset, endpoint):
    return make_job(alice, dataset, endpoint, n_rollouts=16, repeats=4, fail_every=16,
                    rewards=lambda task, rep: REWARDS[task][rep])


def test_each_tasks_figures_over_its_ok_rollouts(api, job):
    r = api.get(f"/api/jobs/{job.pk}/task-profile/")
    assert r.status_code == 200, r.content
    body = r.json()
    by_task = {t["task_index"]: t for t in body["tasks"]}
    assert [t["task_index"] for t in body["tasks"]] == [0, 1, 2, 3]
    for task, rewards in REWARDS.items():
        got = by_task[task]
        ok = rewards[:3] if task == 3 else rewards  # the 16th row (task 3, repeat 3) failed
        assert got["rollouts"] == 4 and got["ok"] == len(ok)
        assert got["mean_reward"] == pytest.approx(statistics.fmean(ok))
        assert got["reward_variance"] == pytest.approx(statistics.pvariance(ok), abs=1e-9)
        assert got["pass_rate"] == pytest.approx(sum(x >= 1.0 for x in ok) / len(ok))
        assert (got["min_reward"], got["max_reward"]) == (min(ok), max(ok))
    assert body["summary"] == {"tasks": 4, "scored": 4, "pass_threshold": 1.0, "zero_variance": 2, "always_pass": 1,
                               "never_pass": 2, "mean_pass_rate": pytest.approx((1 + 0 + 0.5 + 0) / 4)}


def test_threshold_order_and_paging(api, job):
    body = api.get(f"/api/jobs/{job.pk}/task-profile/", {"pass_threshold": 0.5, "order": "-pass_rate"}).json()
    assert [(t["task_index"], t["pass_rate"]) for t in body["tasks"]] == [
        (0, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (1, 0.0)]
    page = api.get(f"/api/jobs/{job.pk}/task-profile/", {"order": "variance", "limit": 2, "offset": 2}).json()
    assert [t["task_index"] for t in page["tasks"]] == [3, 2]  # variances 0, 0, 0.0417, 0.25


def test_csv_has_every_task(api, job):
    r = api.get(f"/api/jobs/{job.pk}/task-profile/", {"format": "csv"})
    assert r.status_code == 200 and r["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(b"".join(r.streaming_content).decode())))
    assert [int(x["task_index"]) for x in rows] == [0, 1, 2, 3]
    assert float(rows[2]["reward_variance"]) == pytest.approx(0.25) and rows[1]["pass_rate"] == "0.0"


def test_another_users_job_and_bad_input(api, bob_api, job):
    assert bob_api.get(f"/api/jobs/{job.pk}/task-profile/").status_code == 404
    for bad in ({"order": "x"}, {"limit": 0}, {"pass_threshold": "nan"}):
        assert api.get(f"/api/jobs/{job.pk}/task-profile/", bad).status_code == 400, bad


def test_the_job_page_shows_the_profile(client, alice, job):
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="task-profile"' in page
    assert "zero variance 2 · always pass 1 · never pass 2" in page
    rows = page.split("<tr data-task=")[1:]
    assert [r.split('"')[1] for r in rows] == ["2", "3", "0", "1"]  # most variance first
    assert f'href="/api/jobs/{job.pk}/task-profile/?format=csv"' in page
