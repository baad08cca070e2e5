"""Under ASGI (the deployed server), the JSONL export leaves in chunks as the rows are read: the first
bytes are sent long before the last rows are fetched, so memory does not grow with the job."""
from __future__ import annotations

import asyncio
import json
import warnings

import pytest
from django.core.handlers.asgi import ASGIHandler
from tests.factories import api_token

from controlplane.jobs.models import CollectionJob, Rollout

from .conftest import make_dataset, make_endpoint

ROWS = 3000


@pytest.fixture
def big_job(transactional_db, django_user_model):
    user = django_user_model.objects.create_user(username="exporter", password="pw-exporter-1")
    job = CollectionJob.objects.create(owner=user, dataset=make_dataset(user), endpoint=make_endpoint(user),
                                       state="completed", total_rollouts=ROWS)
    pad = "x" * 400
    Rollout.objects.bulk_create([Rollout(job=job, task_index=i, rollout_index=0, status="ok", reward=1.0,
                                         data={"_ng_task_index": i, "_ng_rollout_index": 0, "text": pad})
                                 for i in range(ROWS)], batch_size=1000)
    return job, api_token(user)


@pytest.mark.slow
async def test_export_is_streamed_under_asgi(big_job, monkeypatch):
    job, token = big_job
    from controlplane.jobs import export

    produced = []
    real = export.iter_export_lines

    def counting(*a, **kw):
        for line in real(*a, **kw):
            produced.append(1)
            yield line

    monkeypatch.setattr(export, "iter_export_lines", counting)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": f"/api/jobs/{job.pk}/export/", "raw_path": f"/api/jobs/{job.pk}/export/".encode(),
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5555),
             "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Token {token}".encode())]}
    sent = []
    rows_when_first_body = None

    requested = []

    async def receive():
        if not requested:
            requested.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up

    async def send(message):
        nonlocal rows_when_first_body
        if message["type"] == "http.response.body" and message.get("body") and rows_when_first_body is None:
            rows_when_first_body = len(produced)
        sent.append(message)

    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)  # Django warns when it must list a sync iterator whole
        await ASGIHandler()(scope, receive, send)
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    lines = body.splitlines()
    assert len(lines) == ROWS and json.loads(lines[-1])["_ng_task_index"] == ROWS - 1
    assert rows_when_first_body is not None and rows_when_first_body < ROWS / 4, rows_when_first_body


async def _asgi_get(path: str, query: str, token: str, accept: str, on_body=None) -> tuple[int, bytes]:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5555),
             "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Token {token}".encode()),
                         (b"accept", accept.encode())]}
    requested, sent = [], []

    async def receive():
        if not requested:
            requested.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body") and on_body is not None:
            on_body()
        sent.append(message)

    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)
        await ASGIHandler()(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.slow
async def test_a_stream_batch_as_lines_is_streamed_under_asgi(big_job, monkeypatch):
    """The rollout stream's take as JSON lines (what rolloutctl asks for) leaves page by page while the database
    reads the batch, under ASGI; the last line comes once the batch is pending, and the next take (with the
    ack) goes on after it."""
    job, token = big_job
    from controlplane.jobs import stream

    pages = []
    real = stream._plan_rows_pages

    def counting(*a, **kw):
        for page in real(*a, **kw):
            pages.append(len(page))
            yield page

    monkeypatch.setattr(stream, "_plan_rows_pages", counting)
    pages_at_first_body = []
    path = f"/api/jobs/{job.pk}/stream/"
    status, body = await _asgi_get(path, "consumer=asgi&max=2500&fields=id,data", token, "application/x-ndjson",
                                   on_body=lambda: pages_at_first_body.append(len(pages)))
    assert status == 200
    lines = [json.loads(line) for line in body.splitlines()]
    head = lines.pop()["batch"]
    from asgiref.sync import sync_to_async
    from django.db import connection

    def stored_ids():
        try:
            return list(Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True))
        finally:
            connection.close()  # that thread's: the test database is dropped at the end

    ids = await sync_to_async(stored_ids)()
    assert [r["id"] for r in lines] == ids[:2500] and head["count"] == 2500 and head["token"]
    assert len(pages) == 2500 // stream.STREAM_PAGE and pages_at_first_body[0] == 1  # the first page went out first
    status, body = await _asgi_get(path, f"consumer=asgi&max=2500&fields=id&ack={head['token']}", token,
                                   "application/x-ndjson")
    lines = [json.loads(line) for line in body.splitlines()]
    assert status == 200 and [r["id"] for r in lines[:-1]] == ids[2500:] and lines[-1]["batch"]["count"] == 500


@pytest.mark.slow
async def test_a_client_that_stops_reading_is_let_go_and_its_take_rolled_back(big_job, settings):
    """A hostile or stuck client that takes a stream batch as lines and then reads nothing (without hanging up)
    holds the take's transaction, the consumer's lock and a pooled connection only until WEB_SEND_TIMEOUT_S:
    then it is let go as a client gone, the take is rolled back, and the connection is free again."""
    import time

    from asgiref.sync import sync_to_async
    from django.db import connection

    from controlplane.asgi import application
    from controlplane.jobs.models import StreamConsumer

    job, token = big_job
    settings.WEB_SEND_TIMEOUT_S = 0.5
    path = f"/api/jobs/{job.pk}/stream/"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"consumer=stuck&max=2500", "root_path": "",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5555),
             "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Token {token}".encode()),
                         (b"accept", b"application/x-ndjson")]}
    requested, bodies = [], []

    async def receive():
        if not requested:
            requested.append(1)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # never hangs up

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])
            await asyncio.Event().wait()  # ... and never reads a byte of the body

    t0 = time.monotonic()
    await asyncio.wait_for(application(scope, receive, send), 20)
    assert time.monotonic() - t0 < 10 and len(bodies) == 1  # let go after its first part

    def consumer_state():
        try:
            c = StreamConsumer.objects.filter(job=job, name="stuck").first()
            return None if c is None else (c.pending_token, c.cursor, c.delivered)
        finally:
            connection.close()

    assert await sync_to_async(consumer_state)() in (None, ("", 0, 0))  # nothing handed out: the take rolled back
    status, body = await _asgi_get(path, "consumer=stuck&max=10&fields=id", token, "application/x-ndjson")
    assert status == 200 and json.loads(body.splitlines()[-1])["batch"]["count"] == 10  # the lock is free
