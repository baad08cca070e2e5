"""A deadline on each part of a response the server hands to a client.

A streamed answer (the JSONL export, a stream batch as lines) is written while the client reads it, and a large
plain one is sent in 64 KiB parts after the view has returned; either way the request's thread keeps its
database connection (and a streamed take its transaction and the consumer's lock) until the last part is sent.
A client that stops reading without hanging up would hold them for good, and enough of them would hold every
connection of the web process's pool: every other user's request would wait. ASGI middleware in front of Django:
a part that cannot be handed to the server within WEB_SEND_TIMEOUT_S is taken as the client gone, as a disconnect
is (Django closes the response: a streamed take is rolled back, the connection goes back to the pool), and the
connection to that client is dropped.
"""
from __future__ import annotations

import asyncio

from django.conf import settings


class SendDeadlineMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline_s = float(settings.WEB_SEND_TIMEOUT_S)

        async def send_within_deadline(message):
            try:
                await asyncio.wait_for(send(message), deadline_s)
            except asyncio.TimeoutError:
                # as Django's handler takes a client that hung up mid-send: the response is closed, not sent on
                raise asyncio.CancelledError(f"the client read nothing for {deadline_s:g} s") from None

        await self.app(scope, receive, send_within_deadline)
