"""Parallelism sweeps are under the same caps and per-user quotas as jobs (25 sweeps at 16,384 ran a worker out
of file descriptors), and a user can cancel one, from the API and the dashboard: a running sweep stops within
seconds (a real simulator, the sweep running in a thread as a worker runs it)."""
from __future__ import annotations

import threading
import time

import pytest
from django.db import connections
from django.test import Client
from rest_framework.test import APIClient

from controlplane.diagnostics import services
from controlplane.diagnostics.models import ParallelismSweep
from tests.factories import make_dataset, make_endpoint, make_user

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def mallory():
    return make_user("mallory")


@pytest.fixture
def api(mallory, settings):
    settings.CELERY_TASK_ALWAYS_EAGER = False  # queued, never run here: what is checked is what was accepted
    c = APIClient()
    c.force_authenticate(mallory)
    return c


def test_sweep_parallelism_is_capped_like_a_jobs(api, mallory, settings):
    ds, ep = make_dataset(mallory, n=4), make_endpoint(mallory)
    for body in ({"max_parallelism": 16384}, {"levels": [1, 16384]}, {"start_parallelism": 8000, "max_parallelism": 8000}):
        r = api.post("/api/sweeps/", {"endpoint": ep.pk, "dataset": ds.pk, **body}, format="json")
        assert r.status_code == 400 and "JOBS_MAX_PARALLELISM" in str(r.json()), (body, r.content)
    assert not ParallelismSweep.objects.exists()


def test_sweeps_count_against_the_users_quotas(api, mallory, settings):
    settings.JOBS_MAX_PARALLELISM_PER_USER = 8192
    ds, ep = make_dataset(mallory, n=4), make_endpoint(mallory)
    codes = [api.post("/api/sweeps/", {"endpoint": ep.pk, "dataset": ds.pk, "max_parallelism": 4096},
                      format="json").status_code for _ in range(25)]
    assert codes.count(201) == 2 and codes.count(400) == 23, codes  # 2 x 4096 = the user's 8192
    r = api.post("/api/sweeps/", {"endpoint": ep.pk, "dataset": ds.pk, "max_parallelism": 4096}, format="json")
    assert "parallel requests" in str(r.json())
    # and a job does not fit beside them either
    r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "num_samples_in_parallel": 1}, format="json")
    assert r.status_code == 400, r.content
    settings.JOBS_MAX_ACTIVE_PER_USER = 2  # the count of active jobs includes sweeps
    r = api.post("/api/sweeps/", {"endpoint": ep.pk, "dataset": ds.pk, "max_parallelism": 1}, format="json")
    assert r.status_code == 400 and "queued or running" in str(r.json()), r.content


def _run_in_thread(sweep):
    def run():
        try:
            services.run_sweep(ParallelismSweep.objects.get(pk=sweep.pk))
        finally:
            connections.close_all()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_state(sweep, state, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sweep.refresh_from_db()
        if sweep.state == state:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.e2e
def test_a_running_sweep_is_cancelled_from_the_api_and_the_dashboard(api, mallory, simulator_factory):
    sim = simulator_factory(ttft_ms=300, itl_ms=5, jitter=0, seed=0)
    ds, ep = make_dataset(mallory, n=16), make_endpoint(mallory, sim.url, model=sim.model)
    sweep = services.create_sweep(endpoint=ep, dataset=ds, owner=mallory, sample_size=16, levels=[1, 2, 4, 8, 16])
    thread = _run_in_thread(sweep)
    assert _wait_state(sweep, "running", 15)
    time.sleep(0.5)
    t0 = time.monotonic()
    r = api.post(f"/api/sweeps/{sweep.pk}/cancel/", format="json")
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.content
    thread.join(20)
    assert not thread.is_alive() and time.monotonic() - t0 < 20
    sweep.refresh_from_db()
    assert sweep.state == "cancelled"
    assert api.post(f"/api/sweeps/{sweep.pk}/cancel/", format="json").status_code == 409

    # the dashboard: a queued sweep, cancelled from the endpoint page's button, never starts
    queued = services.create_sweep(endpoint=ep, dataset=ds, owner=mallory, sample_size=4, levels=[1])
    web = Client()
    web.force_login(mallory)
    page = web.get(f"/endpoints/{ep.pk}/").content.decode()
    assert f"/sweeps/{queued.pk}/cancel/" in page
    assert web.post(f"/sweeps/{queued.pk}/cancel/").status_code == 302
    assert services.run_sweep(ParallelismSweep.objects.get(pk=queued.pk)).state == "cancelled"
    # another user's sweep is not theirs to cancel
    other = Client()
    other.force_login(make_user("bob"))
    assert other.post(f"/sweeps/{queued.pk}/cancel/").status_code == 404
