"""A request-body size limit that holds before anything parses the body.

ASGI middleware in front of Django: a request whose `Content-Length` is over the limit is answered
413 without reading a byte of it; a body sent without a length (chunked) is counted as it streams in
and cut off with 413 as soon as it passes the limit. The server must stream bodies to the app
(uvicorn does; daphne buffers the whole body first, which is why the web server is uvicorn).

Two limits, both settings:
- REQUEST_MAX_BODY_BYTES for every request (forms, JSON, logins): small.
- UPLOAD_MAX_BODY_BYTES for the dataset upload routes (UPLOAD_PATHS), and only for a request that
  carries credentials (a session cookie or an Authorization header); an anonymous upload gets the
  small limit, so it cannot make the server spool a large body before the login check refuses it.
"""
from __future__ import annotations

from django.conf import settings

TOO_LARGE_BODY = b'{"detail": "Request body too large."}'


class BodyTooLarge(Exception):
    pass


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value
    return None


def body_limit(scope) -> int:
    """The most bytes this request may send."""
    small = int(settings.REQUEST_MAX_BODY_BYTES)
    path = scope.get("path") or ""
    if path in settings.UPLOAD_PATHS:
        cookie = _header(scope, b"cookie") or b""
        has_session = (settings.SESSION_COOKIE_NAME.encode() + b"=") in cookie
        if has_session or _header(scope, b"authorization"):
            return max(small, int(settings.UPLOAD_MAX_BODY_BYTES))
    return small


class BodySizeLimitMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = body_limit(scope)
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _refuse(send, 400, b'{"detail": "Bad Content-Length."}')
            if declared > limit:
                return await _refuse(send, 413, TOO_LARGE_BODY)

        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, TOO_LARGE_BODY)


async def _refuse(send, status: int, body: bytes):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
