"""Login is required everywhere; the ownership rule (controlplane.access) holds on every page, the
JSON views, the actions and the WebSocket."""
from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.urls import reverse

from controlplane.jobs.events import job_group
from tests.factories import make_dataset, make_endpoint, make_job

pytestmark = pytest.mark.django_db


def page_urls(job, rollout_id, dataset_id):
    return [
        reverse("dashboard:overview"),
        reverse("dashboard:overview_state"),
        reverse("dashboard:job", args=[job.pk]),
        reverse("dashboard:job_state", args=[job.pk]),
        reverse("dashboard:rollouts", args=[job.pk]),
        reverse("dashboard:rollout", args=[rollout_id]),
        reverse("dashboard:datasets"),
        reverse("dashboard:dataset", args=[dataset_id]),
        reverse("dashboard:endpoints"),
        reverse("dashboard:compare") + f"?jobs={job.pk},{job.pk}",
        reverse("dashboard:history"),
        reverse("dashboard:history") + "?format=csv",
    ]


def test_anonymous_is_sent_to_login_everywhere(alice_job):
    c = Client()
    r_id = alice_job.rollouts.first().pk
    for url in page_urls(alice_job, r_id, alice_job.dataset_id):
        resp = c.get(url)
        assert resp.status_code == 302, url
        assert resp["Location"].startswith("/accounts/login/"), url
    for action in ("cancel", "pause", "resume", "retry"):
        resp = c.post(reverse("dashboard:job_action", args=[alice_job.pk, action]))
        assert resp.status_code == 302 and resp["Location"].startswith("/accounts/login/")
    resp = c.post(reverse("dashboard:dataset_upload"))
    assert resp.status_code == 302 and resp["Location"].startswith("/accounts/login/")


def test_login_page_renders_and_logs_in(alice):
    c = Client()
    resp = c.get("/accounts/login/")
    assert resp.status_code == 200 and b'name="username"' in resp.content
    resp = c.post("/accounts/login/", {"username": "alice", "password": "alice-pw-123"})
    assert resp.status_code == 302 and resp["Location"] == "/"
    assert c.get("/").status_code == 200


def test_other_users_private_job_is_404(alice_job, bob):
    c = Client()
    c.force_login(bob)
    r_id = alice_job.rollouts.first().pk
    for url in page_urls(alice_job, r_id, alice_job.dataset_id)[2:6] + [reverse("dashboard:dataset", args=[alice_job.dataset_id]),
                                                                         reverse("dashboard:compare") + f"?jobs={alice_job.pk}&jobs={alice_job.pk + 999}"]:
        assert c.get(url).status_code == 404, url
    for action in ("cancel", "pause", "resume", "retry"):
        assert c.post(reverse("dashboard:job_action", args=[alice_job.pk, action])).status_code == 404
    alice_job.refresh_from_db()
    assert alice_job.state == "completed"
    # Lists do not leak it either.
    assert f"#{alice_job.pk} alice-run".encode() not in c.get("/").content
    assert b"alice-run" not in c.get(reverse("dashboard:history")).content
    assert b"alice-run" not in c.get(reverse("dashboard:compare")).content


def test_staff_sees_every_job(alice_job, staff):
    c = Client()
    c.force_login(staff)
    assert c.get(reverse("dashboard:job", args=[alice_job.pk])).status_code == 200
    assert c.get(reverse("dashboard:rollout", args=[alice_job.rollouts.first().pk])).status_code == 200


# --- WebSocket ------------------------------------------------------------------------------------
def _session_cookie(user):
    c = Client()
    c.force_login(user)
    return c.cookies["sessionid"].value


async def _connect(path, user=None):
    from controlplane.asgi import application

    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if user is not None:
        cookie = await sync_to_async(_session_cookie)(user)
        headers.append((b"cookie", f"sessionid={cookie}".encode()))
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await comm.connect(timeout=5)
    return comm, connected


@pytest.mark.django_db(transaction=True)
async def test_socket_refuses_anonymous_and_other_users(alice_job_async):
    job, alice, bob = alice_job_async
    comm, ok = await _connect(f"/ws/jobs/{job.pk}/")
    assert not ok
    comm, ok = await _connect("/ws/overview/")
    assert not ok
    comm, ok = await _connect(f"/ws/jobs/{job.pk}/", bob)
    assert not ok
    comm, ok = await _connect(f"/ws/jobs/{job.pk + 1000}/", alice)
    assert not ok


@pytest.mark.django_db(transaction=True)
async def test_socket_forwards_progress_to_the_owner(alice_job_async):
    job, alice, _ = alice_job_async
    comm, ok = await _connect(f"/ws/jobs/{job.pk}/", alice)
    assert ok
    try:
        msg = {"type": "job.progress", "job_id": job.pk, "state": "running", "total": 10, "completed": 3, "failed": 1,
               "done": 4, "in_flight": 2, "parallelism": 4, "samples_per_s": 1.5, "output_tokens_per_s": 20.0,
               "eta_s": 4.0, "errors": {}, "t": 1.0, "stalled": False}
        # Pub/sub: give the subscription a moment, then publish as the worker's sink does.
        for _ in range(20):
            await get_channel_layer().group_send(job_group(job.pk), msg)
            if not await comm.receive_nothing(timeout=0.2):
                break
        got = await comm.receive_json_from(timeout=5)
        assert got["job_id"] == job.pk and got["done"] == 4 and got["type"] == "job.progress"
        await comm.send_json_to({"type": "ping"})
        # drain any duplicate progress messages, then the pong
        for _ in range(30):
            m = await comm.receive_json_from(timeout=5)
            if m["type"] == "pong":
                break
        else:
            pytest.fail("no pong")
    finally:
        await comm.disconnect()


@pytest.fixture
def alice_job_async(transactional_db, django_user_model):
    alice = django_user_model.objects.create_user(username="alice", password="alice-pw-123")
    bob = django_user_model.objects.create_user(username="bob", password="bob-pw-1234")
    ds = make_dataset(alice, n=5)
    job = make_job(alice, ds, make_endpoint(alice), n_rollouts=5, state="running")
    return job, alice, bob
