"""A catch-up answer overtaken by a live message must not take the job page's figures back in time: the page
asks the server for the job's state when its socket opens; if a newer live message arrives before that answer
does, the answer is older than what is shown, and the page keeps the newer figures."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from channels.layers import get_channel_layer
from django.db import connection

from . import servers
from controlplane.jobs.events import job_group, job_progress
from tests.factories import make_dataset, make_endpoint, make_job, make_user

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def web(transactional_db, monkeypatch):
    servers.prepare_browser(monkeypatch)
    from django.conf import settings

    # the same Redis (and channel prefix) as this process: its messages reach the server's sockets
    env = servers.child_env(servers.database_url(connection.settings_dict), settings.REDIS_URL)
    proc, url = servers.start_web(env)
    try:
        yield url
    finally:
        proc.stop()


def _publish(group: str, message: dict) -> None:
    """From another thread: Playwright's sync API runs an event loop in this one."""
    sender = threading.Thread(target=lambda: asyncio.run(get_channel_layer().group_send(group, message)))
    sender.start()
    sender.join(10)


def _until(page, fn, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not (v := fn()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        page.wait_for_timeout(100)  # not time.sleep: Playwright runs the route handler while it waits
    return v


def test_an_answer_older_than_the_live_figures_does_not_replace_them(web):
    from playwright.sync_api import sync_playwright

    user = make_user("dora", "dora-pw-123")
    job = make_job(user, make_dataset(user, n=50), make_endpoint(user), state="running")
    job.total_rollouts, job.completed_count = 50, 10
    job.save(update_fields=["total_rollouts", "completed_count"])
    held = []  # (route, response): the state answer, built now, delivered later

    def hold(route):
        held.append((route, route.fetch()))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route(f"**/jobs/{job.pk}/state.json*", hold)
            page.goto(f"{web}/jobs/{job.pk}/")
            servers.log_in(page, "dora", "dora-pw-123")  # back to the job page, which opens its socket
            _until(page, lambda: held, 15, "the page's catch-up request (its socket opened)")
            done = lambda: page.evaluate("() => window.dashboardLast && window.dashboardLast.done")  # noqa: E731

            # the job moves on; its live message arrives while the answer (10 done) is on its way
            job.completed_count = 30
            job.save(update_fields=["completed_count"])
            message = {**job_progress(job)}
            for _ in range(50):  # until the socket's subscription carries it
                _publish(job_group(job.pk), message)
                if done() == 30:
                    break
                page.wait_for_timeout(100)
            assert done() == 30
            assert len(held) == 1, held
            route, answer = held[0]
            assert answer.json()["snapshot"]["done"] == 10 and answer.json()["snapshot"]["t"] < message["t"]
            with page.expect_event("requestfinished"):
                route.fulfill(response=answer)
            page.wait_for_timeout(500)  # its JSON parsed and applied
            shown = page.evaluate("""() => ({done: window.dashboardLast.done, t: window.dashboardLast.t,
                field: document.querySelector('#job-progress ~ .kpis [data-field=done]').textContent.trim()})""")
            assert shown["done"] == 30 and shown["t"] == pytest.approx(message["t"]), shown
            assert shown["field"].startswith("30"), shown
        finally:
            browser.close()
