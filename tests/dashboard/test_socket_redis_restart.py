"""The dashboard's job socket through a Redis restart, at the Channels level: the real JobConsumer on the real
pub/sub channel layer, backed by a private redis-server that is restarted while the socket is open. Progress
published after the restart (by another process's layer, as a worker's sink does) reaches the browser, on
the same socket or, if the server closed it, on the one the page's script opens again (static/dashboard/
dashboard.js reconnects with exponential backoff; tests/dashboard/test_browser.py covers that in Chromium)."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from channels.layers import channel_layers, get_channel_layer
from channels.testing import WebsocketCommunicator
from channels_redis.pubsub import RedisPubSubChannelLayer

from controlplane.dashboard.consumers import JobConsumer
from controlplane.jobs.events import job_group

from tests.factories import make_dataset, make_endpoint, make_job
from tests.private_servers import PrivateRedis, Unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def private_layer(tmp_path, settings):
    try:
        redis = PrivateRedis(tmp_path)
        redis.start()
    except Unavailable as exc:
        pytest.skip(str(exc))
    prefix = f"sock-{uuid.uuid4().hex[:6]}"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
                                           "CONFIG": {"hosts": [redis.url()], "prefix": prefix}}}
    channel_layers.backends.clear()
    yield redis, prefix
    channel_layers.backends.clear()
    redis.stop(save=False)


async def _open(user, job_id):
    comm = WebsocketCommunicator(JobConsumer.as_asgi(), f"/ws/jobs/{job_id}/")
    comm.scope["user"] = user
    comm.scope["url_route"] = {"kwargs": {"job_id": job_id}}
    connected, _ = await comm.connect(timeout=10)
    assert connected
    return comm


async def test_job_socket_gets_progress_again_after_redis_restarts(alice, private_layer):
    redis, prefix = private_layer
    from asgiref.sync import sync_to_async

    job = await sync_to_async(lambda: make_job(alice, make_dataset(alice), make_endpoint(alice), state="running"))()
    comm = await _open(alice, job.pk)
    try:
        await get_channel_layer().group_send(job_group(job.pk), {"type": "job.progress", "done": 1})
        assert (await comm.receive_json_from(timeout=5))["done"] == 1

        await asyncio.to_thread(redis.restart, 2.0)

        worker_layer = RedisPubSubChannelLayer(hosts=[redis.url()], prefix=prefix)  # another process's sink
        reopened = 0
        got = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while got is None:
            assert loop.time() < deadline, f"no progress on the socket after the restart (reopened {reopened}x)"
            try:
                await asyncio.wait_for(worker_layer.group_send(job_group(job.pk), {"type": "job.progress", "done": 2}), 2)
            except Exception:  # noqa: BLE001  (its own connection may still be coming back)
                await asyncio.sleep(0.3)
                continue
            try:
                message = await comm.receive_output(timeout=1)
            except asyncio.TimeoutError:
                if not comm.future.done():
                    continue
                message = {"type": "websocket.close"}  # the consumer ended (its layer lost Redis): a server closes the socket
            except (Exception, asyncio.CancelledError):  # noqa: BLE001  (the same, surfaced by the communicator)
                message = {"type": "websocket.close"}
            if message["type"] == "websocket.close":  # what the browser's script does: open the socket again
                reopened += 1
                comm = await _open(alice, job.pk)
                continue
            import json

            got = json.loads(message["text"])
        assert got["done"] == 2
        print(f"\nprogress after the Redis restart: on the {'same' if not reopened else 'reopened'} socket")
        await worker_layer.flush()
    finally:
        try:
            await comm.disconnect()
        except (Exception, asyncio.CancelledError):  # noqa: BLE001  (already ended)
            pass
