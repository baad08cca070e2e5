"""A 4-chunk job on 2 Celery workers, watched in headless Chromium: the job page's in-flight, rate and ETA
are the whole job's (every chunk summed), and agree with the stored rollouts and samples at three moments while it
runs (rate and ETA within 10 %)."""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import connection
from . import servers
from tests.factories import make_dataset

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WINDOW_S = 10.0
PARALLELISM = 16


@pytest.fixture
def two_worker_stack(transactional_db, simulator_factory, django_user_model, monkeypatch):
    servers.prepare_browser(monkeypatch)
    from django.conf import settings

    from controlplane.endpoints.models import Endpoint

    # ~0.4 s per request, 256 slots: the server has room, so the job keeps all 16 slots busy
    sim = simulator_factory(ttft_ms=150, itl_ms=5, output_len_min=40, output_len_max=50, jitter=0.05, seed=4)
    user = django_user_model.objects.create_user(username="dana", password="dana-pw-123")
    # A queue of this test's own (the endpoint routes its chunks there): messages other tests left in the
    # suite's default queue (an ops action against a hung server, say) cannot hold these workers' slots.
    queue = f"progress-{uuid.uuid4().hex[:10]}"
    ep = Endpoint.objects.create(owner=user, name="simulator", base_url=sim.url, model_name=sim.model, max_retries=2,
                                 request_timeout_s=30, worker_queue=queue)
    env = servers.child_env(servers.database_url(connection.settings_dict),
                            settings.REDIS_URL,  # with this run's own channel prefix
                            CELERY_TASK_DEFAULT_QUEUE=queue,
                            JOBS_PROGRESS_MAX_PER_S=4, WORKER_HEARTBEAT_INTERVAL_S=2, JOBS_FLUSH_INTERVAL_S=0.5)
    procs = []
    try:
        daphne, url = servers.start_daphne(env)
        procs.append(daphne)
        procs.append(servers.start_celery(env, concurrency=2, name="progress-a"))
        procs.append(servers.start_celery(env, concurrency=2, name="progress-b"))
        yield {"url": url, "user": user, "endpoint": ep}
    finally:
        for p in reversed(procs):
            p.stop()


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _duration(text: str) -> float:
    parts = [int(x) for x in text.split(":")]
    return float(sum(v * 60 ** i for i, v in enumerate(reversed(parts))))


def _stored_truth(job_id: int, total: int, at) -> dict:
    """What the stored rollouts say at the moment `at` (when the page's numbers were sent): rate over the
    WINDOW_S seconds before it (shorter while the job is younger), done, and the ETA that rate gives."""
    from controlplane.jobs.models import CollectionJob, Rollout

    job = CollectionJob.objects.get(pk=job_id)
    span = min(WINDOW_S, (at - job.started_at).total_seconds())
    mine = Rollout.objects.filter(job_id=job_id, created_at__lte=at)
    recent = mine.filter(created_at__gt=at - timedelta(seconds=span)).count()
    done = mine.count()
    rate = recent / span
    return {"rate": rate, "done": done, "eta": (total - done) / rate if rate else None, **_stored_in_flight(job_id, at)}


def _stored_in_flight(job_id: int, at) -> dict:
    """What the chunks' stored samples say at `at`: each chunk run's latest sample no older than LIVE_FRESH_S and
    still holding requests, summed (requests in flight at the model server: a rollout being verified holds none)."""
    from controlplane.jobs.events import LIVE_FRESH_S
    from controlplane.jobs.models import JobMetricSample

    latest = {}
    at += timedelta(milliseconds=1)  # `at` came as a float of seconds: the message's own chunk's sample is at it
    for worker, t, in_flight, parallelism in (JobMetricSample.objects.filter(job_id=job_id, t__lte=at)
                                              .order_by("t").values_list("worker", "t", "in_flight", "parallelism")):
        latest[worker] = (t, in_flight, parallelism)
    fresh = [(n, p) for t, n, p in latest.values() if (at - t).total_seconds() <= LIVE_FRESH_S and n > 0]
    return {"in_flight": sum(n for n, _ in fresh), "parallelism": sum(p for _, p in fresh), "chunks": len(fresh)}


def test_four_chunks_on_two_workers_page_agrees_with_stored_rollouts(two_worker_stack):
    from playwright.sync_api import sync_playwright

    from controlplane.jobs.models import JobChunk, JobMetricSample
    from controlplane.jobs.services import create_job

    stack = two_worker_stack
    ds = make_dataset(stack["user"], n=400, name="progress-math")
    job = create_job(owner=stack["user"], dataset=ds, endpoint=stack["endpoint"], num_repeats=4,
                     num_samples_in_parallel=PARALLELISM, chunk_size=100, verifier="math", name="four-chunks")
    total = job.total_rollouts
    assert total == 1600 and JobChunk.objects.filter(job=job).count() == 4

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 1000})
            page.goto(stack["url"] + f"/jobs/{job.pk}/")
            servers.log_in(page, "dana", "dana-pw-123")
            page.wait_for_url(f"**/jobs/{job.pk}/", timeout=30000)
            page.wait_for_selector("#live-status.live", timeout=15000)
            kpi = lambda f: page.locator(f"#job-progress ~ .kpis [data-field={f}]").first.inner_text().strip()  # noqa: E731

            moments = []
            for frac in (0.3, 0.5, 0.7):
                deadline = time.monotonic() + 120
                while int(_num(kpi("done") or "0")) < frac * total:
                    assert time.monotonic() < deadline, f"the job did not reach {frac:.0%}: {kpi('done')}"
                    time.sleep(0.2)
                # the shown figures and the time of the message they came from, read in one go
                shown = page.evaluate("""() => {
                    const v = (f) => document.querySelector(`#job-progress ~ .kpis [data-field=${f}]`).textContent.trim();
                    return {in_flight: v("in_flight"), rate: v("samples_per_s"), eta: v("eta_s"),
                            parallelism: v("parallelism"), done: v("done"), t: window.dashboardLast.t};
                }""")
                page_vals = {"in_flight": _num(shown["in_flight"]), "rate": _num(shown["rate"]),
                             "eta": _duration(shown["eta"]), "parallelism": _num(shown["parallelism"]),
                             "done": _num(shown["done"])}
                sent = shown["t"]  # when the numbers on the page were computed
                time.sleep(1.0)  # let the rollouts of that moment reach the database (batched writes)
                truth = _stored_truth(job.pk, total, datetime.fromtimestamp(sent, tz=dt_timezone.utc))
                series = set(JobMetricSample.objects.filter(job_id=job.pk).values_list("worker", flat=True))
                moments.append((frac, page_vals, truth))
                print(f"at {frac:.0%}: page {page_vals} stored {truth} series {sorted(series)}")
            page.screenshot(path=str(servers.REPO / "test-artifacts" / "job_page_four_chunks.png"), full_page=True)
        finally:
            browser.close()

    workers = {s.split(" chunk ")[0].rsplit(":", 2)[0] for s in series}  # "host:pid:celery:thread" -> host:pid
    assert len(workers) == 2, series  # the chunks really ran on both workers
    for frac, page_vals, truth in moments:
        # every chunk's requests, not one chunk's share: the four chunks' latest samples summed, as stored (up to 1
        # off: a chunk's sample stamped just before the message's figures were read may have been committed after)
        assert truth["chunks"] == 4 and truth["parallelism"] == PARALLELISM, (frac, truth)
        assert abs(page_vals["in_flight"] - truth["in_flight"]) <= 1, (frac, page_vals, truth)
        assert 0 < page_vals["in_flight"] <= PARALLELISM, (frac, page_vals)
        assert page_vals["parallelism"] == PARALLELISM
        assert page_vals["rate"] == pytest.approx(truth["rate"], rel=0.10), (frac, page_vals, truth)
        # The counts are the job row's latest (a flush can land after the rates were read): the ETA is what
        # is left of the shown count at the stored rate; the shown count is the stored rows' within 3 s of work.
        assert abs(page_vals["done"] - truth["done"]) <= 3 * truth["rate"], (frac, page_vals, truth)
        eta = (total - page_vals["done"]) / truth["rate"]
        assert page_vals["eta"] == pytest.approx(eta, rel=0.10, abs=1.0), (frac, page_vals, truth, eta)
