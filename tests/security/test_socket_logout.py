"""An open job socket stops at logout: the browser's session logs out (the real logout view) and its live
socket is closed at once, through the channel layer on Redis; a socket whose session went another way (deleted
from the store) stops at its next send."""
from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.sessions.models import Session
from django.test import Client

from controlplane.jobs.events import job_group
from tests.factories import make_dataset, make_endpoint, make_job, make_user

pytestmark = pytest.mark.django_db(transaction=True)

PROGRESS = {"type": "job.progress", "state": "running", "total": 10, "completed": 3, "failed": 0, "done": 3,
            "in_flight": 1, "parallelism": 1, "samples_per_s": 1.0, "output_tokens_per_s": 1.0, "eta_s": 7.0,
            "errors": {}, "t": 1.0, "stalled": False}


def _logged_in():
    alice = make_user("alice")
    job = make_job(alice, make_dataset(alice, n=3), make_endpoint(alice), state="running")
    browser = Client()
    browser.force_login(alice)  # a real session in the store, its cookie in the browser
    return job, browser


async def _open(job, browser):
    from controlplane.asgi import application

    cookie = browser.cookies["sessionid"].value
    comm = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=[
        (b"origin", b"http://localhost"), (b"host", b"localhost"), (b"cookie", f"sessionid={cookie}".encode())])
    connected, _ = await comm.connect(timeout=5)
    assert connected
    # the subscription is live once a published message comes through
    for _ in range(25):
        await get_channel_layer().group_send(job_group(job.pk), {**PROGRESS, "job_id": job.pk})
        if not await comm.receive_nothing(timeout=0.2):
            break
    assert (await comm.receive_json_from(timeout=5))["job_id"] == job.pk
    while not await comm.receive_nothing(timeout=0.3):
        await comm.receive_json_from()
    return comm


async def _closed(comm) -> bool:
    """True when the socket closes within a few seconds, sending no progress before."""
    for _ in range(50):
        out = await comm.receive_output(timeout=5)
        if out["type"] == "websocket.close":
            return True
        assert out["type"] != "websocket.send" or '"job.progress"' not in (out.get("text") or ""), out
    return False


async def test_logout_closes_the_open_job_socket():
    job, browser = await sync_to_async(_logged_in)()
    comm = await _open(job, browser)
    try:
        r = await sync_to_async(browser.post)("/accounts/logout/")
        assert r.status_code in (200, 302)
        await get_channel_layer().group_send(job_group(job.pk), {**PROGRESS, "job_id": job.pk})
        assert await _closed(comm), "the socket kept streaming after logout"
    finally:
        await comm.disconnect()


async def test_a_socket_whose_session_is_gone_stops_at_its_next_send(monkeypatch):
    from controlplane.dashboard import consumers

    job, browser = await sync_to_async(_logged_in)()
    comm = await _open(job, browser)
    try:
        monkeypatch.setattr(consumers, "SESSION_RECHECK_S", 0.0, raising=False)  # check at every send
        await sync_to_async(lambda: Session.objects.all().delete())()  # expired / cleared by the operator
        await get_channel_layer().group_send(job_group(job.pk), {**PROGRESS, "job_id": job.pk})
        assert await _closed(comm), "the socket kept streaming without a session"
    finally:
        await comm.disconnect()
