"""The endpoint page's replica table is live: a run's tick (its ReplicaSet's snapshot, stored by the real DbSink
and published over the real Redis channel layer) reaches the endpoint's socket as the page's own table, with the
figures the user reads there (requests, errors, in / out of rotation and why) changing tick after tick; in
headless Chromium, the same cells change on the open page without a reload."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
from django.test import Client

from tests.factories import make_dataset, make_endpoint, make_job

from . import servers
from .test_access import _connect

pytestmark = pytest.mark.django_db(transaction=True)

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def _rows(html: str) -> dict[str, dict]:
    """The table as the user reads it: per replica URL, its state cell, requests, errors, in flight, reason."""
    out = {}
    for tr in re.findall(r'<tr class="replica-[a-z]+" data-url="[^"]+">.*?</tr>', html, re.S):
        url = re.search(r'data-url="([^"]+)"', tr).group(1)
        def cell(cls, tr=tr):
            return re.sub(r"<[^>]+>", "", re.search(rf'<td class="{cls}">(.*?)</td>', tr, re.S).group(1)).strip()
        out[url] = {"state": cell("replica-state"), "requests": int(cell("replica-requests")),
                    "errors": int(cell("replica-errors")), "in_flight": int(cell("replica-in-flight")),
                    "reason": re.findall(r'<td class="small">(.*?)</td>', tr, re.S)[-1].strip()}
    return out


@pytest.fixture
def running_job(django_user_model):
    from controlplane.jobs.models import JobChunk

    alice = django_user_model.objects.create_user(username="alice", password="alice-pw-123")
    bob = django_user_model.objects.create_user(username="bob", password="bob-pw-1234")
    ep = make_endpoint(alice, A, replica_urls=[B])
    job = make_job(alice, make_dataset(alice, n=5), ep, n_rollouts=0, state="running")
    chunk = JobChunk.objects.create(job=job, index=0, start_row=0, end_row=5, state="running", lease_owner="w#1")
    return job, chunk, alice, bob


def _tick_for(sink, replicas):
    from workers.engine.types import ProgressTick

    return sink.progress(ProgressTick(elapsed_s=1.0, completed=replicas.replicas[0].ok, failed=0, in_flight=1,
                                      parallelism=4, samples_per_s=1.0, output_tokens_per_s=9.0,
                                      extra={"replicas": replicas.snapshot()}))


async def _next_table(comm) -> dict[str, dict]:
    msg = await comm.receive_json_from(timeout=10)
    assert msg["type"] == "endpoint.replicas"
    return _rows(msg["html"])


@pytest.mark.slow
async def test_replica_table_follows_the_runs_ticks(running_job):
    from controlplane.jobs.sink import DbSink, DbThread
    from workers.engine.replicas import ReplicaSet

    job, chunk, alice, bob = running_job
    path = f"/ws/endpoints/{job.endpoint_id}/"
    comm, ok = await _connect(path, bob)
    assert not ok  # another user's endpoint: refused
    comm, ok = await _connect(path)
    assert not ok
    comm, ok = await _connect(path, alice)
    assert ok
    db = DbThread()
    sink = DbSink(job=job, chunk=chunk, lease_owner="w#1", worker_name="w", db=db, max_publish_per_s=50)
    replicas = ReplicaSet([A, B])

    async def tick():
        await _tick_for(sink, replicas)
        # The socket sends at most one table a second and the subscription may lag the first nudge: read until
        # the table shows what this tick stored.
        return await _next_table(comm)

    try:
        first = await _next_table(comm)  # at connect: no run has reported yet
        assert [first[u]["state"] for u in (A, B)] == ["idle", "idle"]

        for _ in range(5):
            replicas.begin(0), replicas.succeeded(0), replicas.end(0)
        replicas.begin(1), replicas.succeeded(1), replicas.end(1)
        replicas.begin(0)  # one request still in flight on A
        table = await tick()
        for _ in range(10):
            if table[A]["requests"] == 6:
                break
            table = await _next_table(comm)
        assert table[A] == {"state": "in rotation", "requests": 6, "errors": 0, "in_flight": 1, "reason": ""}
        assert table[B] == {"state": "in rotation", "requests": 1, "errors": 0, "in_flight": 0, "reason": ""}

        # B refuses connections: out of rotation at its first refusal, with the reason; A keeps the load
        replicas.end(0), replicas.succeeded(0)
        for _ in range(3):
            replicas.begin(1), replicas.end(1)
            replicas.failed(1, "cannot connect: Connection refused", replica_fault=True, unreachable=True)
        table = await tick()
        for _ in range(10):
            if table[B]["errors"] == 3:
                break
            table = await _next_table(comm)
        assert table[A] == {"state": "in rotation", "requests": 6, "errors": 0, "in_flight": 0, "reason": ""}
        assert table[B]["state"] == "out of rotation" and (table[B]["requests"], table[B]["errors"]) == (4, 3)
        assert table[B]["reason"].startswith("cannot connect: cannot connect: Connection refused")

        # B answers again: back in rotation, its errors kept (cumulative for the run)
        replicas.begin(1), replicas.succeeded(1), replicas.end(1)
        table = await tick()
        for _ in range(10):
            if table[B]["state"] == "in rotation":
                break
            table = await _next_table(comm)
        assert table[B] == {"state": "in rotation", "requests": 5, "errors": 3, "in_flight": 0,
                            "reason": "cannot connect: Connection refused"}

        # the page can ask at any time (a window expiring sends no tick): the same table comes back
        await comm.send_json_to({"type": "refresh"})
        assert await _next_table(comm) == table
    finally:
        await sink.close()
        db.close()
        await comm.disconnect()


def test_the_page_renders_the_same_table_and_opens_the_socket(running_job):
    job, _, alice, _ = running_job
    c = Client()
    c.force_login(alice)
    html = c.get(f"/endpoints/{job.endpoint_id}/").content.decode()
    assert '<script id="endpoint-init" type="application/json">{"ws_path": "/ws/endpoints/%d/"}</script>' % job.endpoint_id in html
    assert 'data-page="endpoint"' in html and 'id="replica-load-live"' in html
    assert [r["state"] for r in _rows(html).values()] == ["idle", "idle"]


def _wait_until(ok, what, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.2)


@pytest.mark.browser
def test_the_open_page_shows_each_tick_without_a_reload(running_job, monkeypatch):
    """The endpoint page open in Chromium (uvicorn, real Redis and PostgreSQL); a run's ticks are stored and
    published from this process as a worker's sink does: the replica cells change in place."""
    servers.prepare_browser(monkeypatch)
    from django.conf import settings
    from django.db import connection
    from playwright.sync_api import sync_playwright

    from controlplane.jobs.sink import DbSink, DbThread
    from workers.engine.replicas import ReplicaSet

    job, chunk, alice, _ = running_job
    replicas = ReplicaSet([A, B])

    def tick():
        """One tick of the run, stored and published by a DbSink on a loop of its own (as in a worker)."""
        async def run():
            db = DbThread()
            sink = DbSink(job=job, chunk=chunk, lease_owner="w#1", worker_name="w", db=db, max_publish_per_s=50)
            try:
                await _tick_for(sink, replicas)
            finally:
                await sink.close()
                db.close()

        t = threading.Thread(target=asyncio.run, args=(run(),))
        t.start()
        t.join(30)

    web, url = servers.start_web(servers.child_env(servers.database_url(connection.settings_dict), settings.REDIS_URL))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(url + "/accounts/login/")
                servers.log_in(page, "alice", "alice-pw-123")
                page.goto(f"{url}/endpoints/{job.endpoint_id}/")
                page.wait_for_selector("#live-status.live", timeout=15000)
                page.evaluate("window.__noReload = 'still here'")
                cell = lambda u, cls: page.locator(f'tr[data-url="{u}"] .{cls}').inner_text().strip()  # noqa: E731
                assert cell(A, "replica-state") == cell(B, "replica-state") == "idle"

                for _ in range(5):
                    replicas.begin(0), replicas.succeeded(0), replicas.end(0)
                tick()
                _wait_until(lambda: cell(A, "replica-requests") == "5", "A's 5 requests")
                assert cell(A, "replica-state") == cell(B, "replica-state") == "in rotation"

                for _ in range(3):
                    replicas.begin(1), replicas.end(1)
                    replicas.failed(1, "cannot connect: Connection refused", replica_fault=True, unreachable=True)
                tick()
                _wait_until(lambda: cell(B, "replica-errors") == "3", "B's 3 errors")
                assert cell(B, "replica-state") == "out of rotation" and cell(B, "replica-requests") == "3"
                assert cell(A, "replica-requests") == "5" and cell(A, "replica-state") == "in rotation"
                assert page.evaluate("window.__noReload") == "still here"
            finally:
                browser.close()
    finally:
        web.stop()
