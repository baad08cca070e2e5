"""WebSocket consumers: thin. Authenticate, check the ownership rule, join the job's group, forward.

Progress messages are published by the jobs runtime's sink to group `job-<id>` with type
`job.progress` (controlplane/jobs/events.py); the handler below forwards them as JSON unchanged.
"""
from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.access import visible_jobs
from controlplane.jobs.events import job_group
from controlplane.jobs.models import ACTIVE_STATES

# Close codes (sent only after accept; a refused handshake is an HTTP 403 to the browser).
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
        await self.send_json(event)


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
