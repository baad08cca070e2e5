"""Throughput figures: tokens/s and output tokens/s from the stored rows (controlplane.jobs.figures) in the
job's figures and in History, and History over the API with a token (JSON and throughput_log.csv)."""
from __future__ import annotations

import csv
import io

import pytest
from django.utils import timezone

from controlplane.jobs import figures
from controlplane.jobs.models import JobMetricSample, Rollout
from tests.factories import api_token, make_dataset, make_endpoint, make_job, make_user

TD = timezone.timedelta


def _job_at(owner, ds, ep, *, rate: float, seconds: int = 20, out_tokens: int = 50, in_tokens: int = 10,
            reward: float = 0.8, name: str = ""):
    """A completed job that ran `seconds` s at `rate` rollouts/s: one sample a second and the rows it stored,
    each with `in_tokens` + `out_tokens`."""
    job = make_job(owner, ds, ep, n_rollouts=0, state="completed", name=name)
    JobMetricSample.objects.filter(job=job).delete()
    now = timezone.now() - TD(seconds=60)
    rows, stored = [], 0
    for k in range(1, seconds + 1):
        t = now + TD(seconds=k)
        n = int(rate * k) - stored
        rows += [Rollout(job=job, task_index=stored + i, rollout_index=0, data={}, reward=reward, input_tokens=in_tokens,
                         output_tokens=out_tokens, created_at=t) for i in range(n)]
        stored += n
        JobMetricSample.objects.create(job=job, worker="w chunk 0", t=t, elapsed_s=float(k), completed=stored,
                                       in_flight=4, parallelism=4)
    Rollout.objects.bulk_create(rows)
    job.completed_count, job.total_rollouts = stored, stored
    job.aggregate_metrics = {"mean/reward": reward}
    job.save(update_fields=["completed_count", "total_rollouts", "aggregate_metrics"])
    return job


@pytest.mark.django_db
def test_token_rates_are_stored_tokens_over_running_time():
    u = make_user("tok")
    job = _job_at(u, make_dataset(u), make_endpoint(u), rate=10.0, seconds=20, out_tokens=50, in_tokens=10)
    f = figures.job_figures(job)
    assert f["running_s"] == pytest.approx(20, abs=1)
    assert f["input_tokens"] == 200 * 10 and f["output_tokens"] == 200 * 50
    assert f["average_output_tokens_per_s"] == pytest.approx(500, rel=0.05)  # 10/s x 50
    assert f["average_tokens_per_s"] == pytest.approx(600, rel=0.05)  # 10/s x (10 + 50)
    many = figures.history_figures([job])[job.pk]  # History's reading: the same figures
    assert many["tokens_per_s"] == pytest.approx(f["average_tokens_per_s"], abs=0.01)
    assert many["output_tokens_per_s"] == pytest.approx(f["average_output_tokens_per_s"], abs=0.01)
    # new rows: a new cached sum (keyed by the stored count), never the old one
    Rollout.objects.create(job=job, task_index=999, rollout_index=0, data={}, output_tokens=1000)
    job.completed_count += 1
    job.save(update_fields=["completed_count"])
    assert figures.job_figures(job)["output_tokens"] == 200 * 50 + 1000


def rated_jobs():
    """(token, slow, fast, worse): 5/s, 20/s, and 20/s with a lower reward (0.5 against 0.8)."""
    u = make_user("ci")
    ds, ep = make_dataset(u), make_endpoint(u)
    slow = _job_at(u, ds, ep, rate=5.0, reward=0.8, name="slow")
    fast = _job_at(u, ds, ep, rate=20.0, reward=0.8, name="fast")
    worse = _job_at(u, ds, ep, rate=20.0, reward=0.5, name="worse-reward")
    return api_token(u), slow, fast, worse


@pytest.fixture
def jobs(transactional_db):
    return rated_jobs()


def test_history_over_the_api_with_a_token(jobs, live_server):
    import json
    import urllib.request

    token, slow, fast, _ = jobs

    def get(path):
        req = urllib.request.Request(live_server.url + path, headers={"Authorization": f"Token {token}"})
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.headers.get("Content-Type"), r.read().decode()

    ctype, body = get("/api/history/")
    rows = {r["job_id"]: r for r in json.loads(body)["results"]}
    assert rows[slow.pk]["rollouts_per_s"] == pytest.approx(5.0, rel=0.05)
    assert rows[fast.pk]["tokens_per_s"] == pytest.approx(20 * 60, rel=0.05)
    assert rows[fast.pk]["output_tokens_per_s"] == pytest.approx(20 * 50, rel=0.05)
    ctype, body = get("/api/history/?format=csv")
    assert ctype.startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(body)))
    by_id = {int(r["job_id"]): r for r in table}
    assert float(by_id[fast.pk]["tokens_per_sec"]) == pytest.approx(1200, rel=0.05)
    assert float(by_id[slow.pk]["output_tokens_per_sec"]) == pytest.approx(250, rel=0.05)
    # no token: 401, not the login page
    try:
        urllib.request.urlopen(live_server.url + "/api/history/", timeout=10)
        raise AssertionError("anonymous history answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
