"""WebSocket consumers: thin. Authenticate, check the ownership rule, join the job's group, forward.

Progress messages are published by the jobs runtime's sink to group `job-<id>` with type
`job.progress` (controlplane/jobs/events.py); the handler below forwards them as JSON unchanged.
The endpoint page's socket joins `endpoint-<id>`: the sink nudges it when a run stored a replica table, and
the consumer answers with the endpoint's replica load read from the database (controlplane.jobs.replica_load).
"""
from __future__ import annotations

import asyncio
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.template.loader import render_to_string

from controlplane.access import visible_endpoints, visible_jobs
from controlplane.disclosure import error_for, shown_for
from controlplane.jobs.replica_load import LIVE_MESSAGE_TYPE, endpoint_group, replica_load
from controlplane.jobs.events import job_group
from controlplane.jobs.models import ACTIVE_STATES

from .sessions import SESSION_RECHECK_S, session_group, session_user_id

# Close codes (sent only after accept; a refused handshake is an HTTP 403 to the browser).
SESSION_ENDED = 4401  # logged out (or the session expired): the page's reconnects are refused from now on
MAX_OVERVIEW_JOBS = 50


@database_sync_to_async
def _visible_job_id(user, job_id):
    return visible_jobs(user).filter(pk=job_id).values_list("pk", flat=True).first()


@database_sync_to_async
def _active_job_ids(user):
    return list(visible_jobs(user).filter(state__in=ACTIVE_STATES).order_by("-created_at")
                .values_list("pk", flat=True)[:MAX_OVERVIEW_JOBS])


class ProgressConsumer(AsyncJsonWebsocketConsumer):
    """Base of the progress sockets: authenticated users only; joins the groups `groups_for` returns (None:
    refuse the handshake), forwards `job.progress` messages (events.progress_payload) unchanged, answers
    pings, leaves its groups on disconnect."""

    async def groups_for(self, user) -> list[str] | None:
        raise NotImplementedError

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # before accept: the handshake is refused
            return
        joined = await self.groups_for(user)
        if joined is None:
            await self.close()
            return
        self.session_key = getattr(self.scope.get("session"), "session_key", None)
        if self.session_key:  # logging out closes this socket (sessions.py)
            joined = [*joined, session_group(self.session_key)]
        self.user_id = str(user.pk)
        self.session_checked = time.monotonic()
        self.joined = joined
        for g in joined:
            await self.channel_layer.group_add(g, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        for g in getattr(self, "joined", []):
            await self.channel_layer.group_discard(g, self.channel_name)

    async def receive_json(self, content, **kwargs):
        # Clients only listen; a ping keeps proxies from closing an idle socket.
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def job_progress(self, event):
        if event.get("error_message"):  # a failed job's reason, as this user may read it
            event = dict(event, error_message=error_for(self.scope.get("user"), event["error_message"]))
        await self.send_json(event)

    async def session_ended(self, event):
        await self.close(code=SESSION_ENDED)

    async def send_json(self, content, close=False):
        """Send only while the session this socket was opened with is still this user's (checked at most every
        SESSION_RECHECK_S; a logout closes the socket at once through session_ended)."""
        if time.monotonic() - getattr(self, "session_checked", 0.0) > SESSION_RECHECK_S:
            self.session_checked = time.monotonic()
            alive = bool(self.session_key) and await database_sync_to_async(session_user_id)(self.session_key) == self.user_id
            if not alive:
                await self.close(code=SESSION_ENDED)
                return
        await super().send_json(content, close=close)


class JobConsumer(ProgressConsumer):
    """ws/jobs/<job_id>/ : the live progress of one job."""

    async def groups_for(self, user):
        try:
            job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        except (KeyError, TypeError, ValueError):
            return None
        if await _visible_job_id(user, job_id) is None:
            return None
        self.job_id = job_id
        self.group = job_group(job_id)
        return [self.group]


class OverviewConsumer(ProgressConsumer):
    """ws/overview/ : progress of every active job the user can see (joined at connect; the page
    refreshes its list from /overview.json and reconnects to pick up jobs started later)."""

    async def groups_for(self, user):
        return [job_group(i) for i in await _active_job_ids(user)]


REPLICAS_MIN_INTERVAL_S = 1.0  # several runs nudge at once: the table is read at most this often per socket


@database_sync_to_async
def _visible_endpoint(user, endpoint_id):
    return visible_endpoints(user).filter(pk=endpoint_id).first()


@database_sync_to_async
def _replica_message(endpoint, user) -> dict:
    endpoint.refresh_from_db(fields=["last_health", "base_url", "replica_urls"])
    load = shown_for(user, replica_load(endpoint))  # never what a server said, for non-staff
    return {"type": LIVE_MESSAGE_TYPE, "endpoint_id": endpoint.pk, "load": load,
            "html": render_to_string("dashboard/_replica_load.html", {"load": load})}


class EndpointConsumer(ProgressConsumer):
    """ws/endpoints/<endpoint_id>/ : the endpoint's per-replica load (the table of its page, rendered by the
    page's own template), sent at connect, on every run's nudge (at most once per REPLICAS_MIN_INTERVAL_S, the
    latest always going out) and when the page asks ({"type": "refresh"}: windows expire without a nudge)."""

    async def groups_for(self, user):
        try:
            endpoint_id = int(self.scope["url_route"]["kwargs"]["endpoint_id"])
        except (KeyError, TypeError, ValueError):
            return None
        self.endpoint = await _visible_endpoint(user, endpoint_id)
        if self.endpoint is None:
            return None
        self.last_sent = 0.0
        self.dirty = False  # a nudge came after the last read began
        self.pending: asyncio.Task | None = None
        return [endpoint_group(endpoint_id)]

    async def connect(self):
        await super().connect()
        if getattr(self, "endpoint", None) is not None and getattr(self, "joined", None):
            await self.send_replicas()

    async def disconnect(self, code):
        if getattr(self, "pending", None) is not None:
            self.pending.cancel()
        await super().disconnect(code)

    async def receive_json(self, content, **kwargs):
        if isinstance(content, dict) and content.get("type") == "refresh":
            await self.endpoint_replicas({})
        else:
            await super().receive_json(content, **kwargs)

    async def endpoint_replicas(self, event):
        self.dirty = True
        if self.pending is None or self.pending.done():
            self.pending = asyncio.ensure_future(self._send_while_dirty())

    async def _send_while_dirty(self):
        while self.dirty:
            wait = self.last_sent + REPLICAS_MIN_INTERVAL_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.dirty = False
            await self.send_replicas()

    async def send_replicas(self):
        self.last_sent = time.monotonic()
        await self.send_json(await _replica_message(self.endpoint, self.scope.get("user")))
