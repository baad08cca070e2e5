"""The job page's profiling panel in headless Chromium against a live daphne: the table of the seed's
columns sorts on a click and refreshes by itself when a worker stores a new snapshot (no reload), the
flame graph (d3-flame-graph from npm) draws the call tree, and the buttons switch profiling on and off."""
from __future__ import annotations

import os
import time

import pytest
from django.db import connection

from controlplane.jobs import services as job_services
from controlplane.profiling import services
from tests.dashboard import servers
from workers.profiling.core import FuncRow, ProfileSnapshot as Snap

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
REDIS_DB = int(os.environ.get("DASHBOARD_TEST_REDIS_DB", "11"))


def _snap(session, scale):
    rows = [FuncRow("/srv/verifier.py", 10, "Verifier.verify", 100 * scale, 0.05 * scale, 2.0 * scale, 0.02,
                    [["/srv/verifier.py", 30, "is_known_answer", 100 * scale, 1.6 * scale],
                     ["/srv/verifier.py", 20, "normalize_answer", 300 * scale, 0.35 * scale]]),
            FuncRow("/srv/verifier.py", 30, "is_known_answer", 100 * scale, 1.6 * scale, 1.6 * scale, 0.016),
            FuncRow("/srv/verifier.py", 20, "normalize_answer", 300 * scale, 0.35 * scale, 0.35 * scale, 0.00117)]
    t = time.time()
    return Snap(session=session.key, scope="verify", clock="wall", worker="host-a", window_start=t - 1, window_end=t,
                rows=rows, verifications=100 * scale, profiled=10 * scale, overhead_pct=1.1)


def test_profiling_panel_live_sortable_flame_and_switch(transactional_db, django_user_model, monkeypatch, math_dataset,
                                                        sim_endpoint):
    servers.prepare_browser(monkeypatch)
    from django.conf import settings
    from playwright.sync_api import sync_playwright

    user = django_user_model.objects.create_user(username="pat", password="pat-pw-123")
    job = job_services.create_job(owner=user, dataset=math_dataset(10), endpoint=sim_endpoint("http://127.0.0.1:9"),
                                  launch=False)
    job.state = "running"
    job.save(update_fields=["state"])
    session = services.start(job, seconds=600)
    services.record(job.pk, [_snap(session, 1)])

    env = servers.child_env(servers.database_url(connection.settings_dict),
                            servers.redis_url_with_db(settings.REDIS_URL, REDIS_DB))
    daphne, url = servers.start_daphne(env)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1360, "height": 1400},
                                        bypass_csp=True)  # Playwright polls wait_for_function with eval; the page itself runs under the CSP (test_browser checks it)
                errors = []
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(url + "/history/")
                servers.log_in(page, "pat", "pat-pw-123")
                page.goto(f"{url}/jobs/{job.pk}/")

                first = "#profiling-table tbody tr:first-child td:first-child"
                page.wait_for_selector(first)
                assert page.inner_text(first).startswith("Verifier.verify")  # by ttot, largest first
                assert "Profiling on" in page.inner_text("#profiling-status")
                flags = page.inner_text("#profiling-flags")
                assert "is_known_answer" in flags and "over_half" in flags
                def first_is(name):
                    page.wait_for_function(f"(document.querySelector('{first}') || {{}}).textContent"
                                           f"?.startsWith('{name}')", timeout=10000)

                page.click("#profiling-table th[data-key=ncall]")  # sort by ncall
                first_is("normalize_answer")
                page.click("#profiling-table th[data-key=tavg]")
                first_is("Verifier.verify")

                # the flame graph of the call tree
                page.wait_for_selector("#profiling-flame svg g", timeout=15000)
                flame = page.eval_on_selector("#profiling-flame", "e => e.textContent")
                assert "is_known_answer" in flame and "Verifier.verify" in flame, flame[:300]
                assert page.locator("#profiling-flame svg g.frame").count() >= 4  # root, verify and its two children

                # a worker stores a new window: the table follows without a reload
                services.record(job.pk, [_snap(session, 3)])
                deadline = time.monotonic() + 15
                while "snapshots" not in page.inner_text("#profiling-status") or \
                        "2 snapshots" not in page.inner_text("#profiling-status"):
                    assert time.monotonic() < deadline, page.inner_text("#profiling-status")
                    page.wait_for_timeout(300)
                page.click("#profiling-table th[data-key=ncall]")
                first_is("normalize_answer")
                row = page.inner_text("#profiling-table tbody tr:first-child")
                assert row.startswith("normalize_answer") and "1200" in row  # 300 + 900 calls

                # off, then on again from the buttons
                page.click("#profile-stop")
                page.wait_for_function("!document.querySelector('#profiling-status').textContent.includes('Profiling on')")
                assert services.active_session(job.pk) is None
                page.select_option("#profiling-controls select[name=clock]", "cpu")
                page.fill("#profiling-controls input[name=seconds]", "30")
                page.click("#profile-start")
                page.wait_for_function("document.querySelector('#profiling-status').textContent.includes('Profiling on')")
                s = services.active_session(job.pk)
                assert s.seconds == 30 and s.clock == "cpu"
                shots = servers.REPO / "test-artifacts"
                shots.mkdir(exist_ok=True)
                page.locator("#profiling-panel").screenshot(path=str(shots / "profiling-panel.png"))
                assert not [e for e in errors if "profiling" in e.lower() or "flame" in e.lower()], errors
            finally:
                browser.close()
    finally:
        daphne.stop()
