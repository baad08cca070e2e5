"""One user's share of a web process: requests open at once are capped per user (API_USER_MAX_IN_FLIGHT), each
counted until its answer is sent, so a user whose requests hang on cannot hold every pooled database connection
while other users wait."""
from __future__ import annotations

import asyncio
import json

import pytest
from django.test import Client
from tests.factories import api_token

from controlplane.jobs.models import CollectionJob, Rollout

from .conftest import make_dataset, make_endpoint

ROWS = 50


def _job(user):
    job = CollectionJob.objects.create(owner=user, dataset=make_dataset(user), endpoint=make_endpoint(user),
                                       state="completed", total_rollouts=ROWS)
    Rollout.objects.bulk_create([Rollout(job=job, task_index=i, rollout_index=0, status="ok", reward=1.0,
                                         data={"_ng_task_index": i, "_ng_rollout_index": 0, "text": "x" * 100})
                                 for i in range(ROWS)])
    return job


@pytest.fixture
def two_users(transactional_db, django_user_model):
    hog = django_user_model.objects.create_user(username="hog", password="pw-hog-12345")
    other = django_user_model.objects.create_user(username="other", password="pw-other-12345")
    return (_job(hog), api_token(hog)), (_job(other), api_token(other))


def _scope(path: str, query: str, token: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5555),
            "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Token {token}".encode()),
                        (b"accept", b"application/x-ndjson")]}


async def _get(path: str, query: str, token: str) -> tuple[int, bytes]:
    from controlplane.asgi import application

    status, body, requested = [], [], []

    async def receive():
        if not requested:
            requested.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # does not hang up

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    await asyncio.wait_for(application(_scope(path, query, token), receive, send), 20)
    return status[0], b"".join(body)


class StuckClient:
    """Takes a stream batch as lines, then reads nothing and does not hang up -- until told to."""

    def __init__(self, path: str, query: str, token: str):
        self.scope = _scope(path, query, token)
        self.hang_up = asyncio.Event()
        self.started = asyncio.Event()
        self.requested = False
        self.task = None

    async def receive(self):
        if not self.requested:
            self.requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        if message["type"] == "http.response.body" and message.get("body"):
            self.started.set()
            await asyncio.Event().wait()  # never reads

    async def open(self):
        from controlplane.asgi import application

        self.task = asyncio.create_task(application(self.scope, self.receive, self.send))
        await asyncio.wait_for(self.started.wait(), 20)

    async def close(self):
        self.hang_up.set()
        await asyncio.wait_for(self.task, 20)


@pytest.mark.slow
async def test_a_users_stuck_requests_take_only_their_share(two_users, settings):
    from controlplane import inflight

    (job, token), (other_job, other_token) = two_users
    settings.API_USER_MAX_IN_FLIGHT = 2
    settings.WEB_SEND_TIMEOUT_S = 60
    path = f"/api/jobs/{job.pk}/stream/"
    stuck = [StuckClient(path, f"consumer=hog{k}&max=10", token) for k in range(2)]
    try:
        for s in stuck:
            await s.open()
        key = f"user:{job.owner_id}"
        assert inflight.open_requests(key) == 2

        status, body = await _get(path, "consumer=hog2&max=10", token)  # a third request of the same user
        assert status == 429 and b"API_USER_MAX_IN_FLIGHT" in body, body
        status, body = await _get(f"/api/jobs/{other_job.pk}/stream/", "consumer=t&max=10", other_token)
        assert status == 200 and json.loads(body.splitlines()[-1])["batch"]["count"] == 10  # the other user is served
    finally:
        for s in stuck:  # they hang up mid-answer: Django does not close those responses, the places are freed anyway
            if s.task is not None:
                await s.close()
    assert inflight.open_requests(key) == 0
    status, body = await _get(path, "consumer=hog0&max=10", token)
    assert status == 200 and json.loads(body.splitlines()[-1])["batch"]["count"] == 10  # rolled back: same rows


def test_a_streamed_answer_holds_its_place_until_read(two_users, settings):
    """Any server (here Django's test client): the place is freed when the response is closed, after its body."""
    from controlplane import inflight

    (job, token), _ = two_users
    settings.API_USER_MAX_IN_FLIGHT = 1
    client = Client(HTTP_AUTHORIZATION=f"Token {token}")
    for _ in range(3):  # one at a time: each is freed when answered
        assert client.get(f"/api/jobs/{job.pk}/").status_code == 200
    export = client.get(f"/api/jobs/{job.pk}/export/", HTTP_ACCEPT="application/x-ndjson")
    assert export.status_code == 200 and export.streaming
    assert client.get(f"/api/jobs/{job.pk}/").status_code == 429  # the export is still going out
    assert len(b"".join(export.streaming_content).splitlines()) == ROWS
    assert inflight.open_requests(f"user:{job.owner_id}") == 0
    assert client.get(f"/api/jobs/{job.pk}/").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("server", ["drops", "raises"])
async def test_a_long_poll_whose_client_hung_up_counts_until_its_view_returns(two_users, settings, server):
    """A client that hangs up on a long-poll take: the take goes on waiting in its thread with its pooled
    connection, and Django never closes the response it returns. It keeps its place until then (hanging up and
    asking again cannot open more than the user's share), and is freed after, whether the server drops what is
    sent to a client gone (uvicorn) or raises (then Django closes no response)."""
    import time

    from controlplane import inflight
    from controlplane.asgi import application

    (job, token), _ = two_users
    settings.API_USER_MAX_IN_FLIGHT = 1
    path = f"/api/jobs/{job.pk}/stream/"
    status, body = await _get(path, f"consumer=poll&max={ROWS}", token)  # drained: the next take long-polls
    assert status == 200
    drained = json.loads(body.splitlines()[-1])["batch"]
    assert drained["count"] == ROWS
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(0.5)  # the take is waiting by now
        return {"type": "http.disconnect"}

    async def send(message):
        if server == "raises":
            raise OSError("the client is gone")

    scope = _scope(path, f"consumer=poll&max=10&wait=3&ack={drained['token']}", token)
    scope["headers"] = [h for h in scope["headers"] if h[0] != b"accept"]
    task = asyncio.create_task(application(scope, receive, send))
    await asyncio.sleep(1.0)  # it hung up after 0.5 s; the take waits on in its thread
    key = f"user:{job.owner_id}"
    assert not task.done() and inflight.open_requests(key) == 1
    status, _ = await _get(path, "consumer=poll3&max=10", token)
    assert status == 429
    await asyncio.wait_for(task, 20)  # once the take returns; Django does not close that response
    deadline = time.monotonic() + 5
    while inflight.open_requests(key) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert inflight.open_requests(key) == 0  # freed all the same
    status, _ = await _get(path, "consumer=poll3&max=10", token)
    assert status == 200
