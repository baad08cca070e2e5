"""Each user's share of a web process: at most API_USER_MAX_IN_FLIGHT of their requests at once.

A request holds one of the web process's pooled database connections (DB_POOL_MAX_SIZE) until its answer's last
part is sent: a long-poll take while it waits (up to 30 s), a streamed export or stream batch while the client
reads it (up to WEB_SEND_TIMEOUT_S per part). The API's rate throttle counts requests per minute, not how many are
open, so one user opening many slow requests at once could hold the whole pool and every other user would wait.
A request is counted from the throttle check (after authentication) until its response is closed after its last
part is sent, or, under ASGI, until the server is done with the request however it ended (Django closes no
response whose sending failed).

Counted per web process because the pool it protects is per process. Core: no app imports.
"""
from __future__ import annotations

import threading
from typing import Callable

SCOPE_KEY = "controlplane.inflight_releases"  # in the ASGI scope: what InFlightMiddleware runs at the end

_lock = threading.Lock()
_open: dict[str, int] = {}


def acquire(key: str, cap: int) -> Callable[[], None] | None:
    """A place for one more request of `key`, or None when `cap` of its requests are open. The release it gives
    is idempotent (it may be run by the response's close and again by the ASGI middleware)."""
    with _lock:
        if _open.get(key, 0) >= cap:
            return None
        _open[key] = _open.get(key, 0) + 1
    done = False

    def release() -> None:
        nonlocal done
        with _lock:
            if done:
                return
            done = True
            left = _open.get(key, 0) - 1
            if left > 0:
                _open[key] = left
            else:
                _open.pop(key, None)

    return release


def open_requests(key: str) -> int:
    with _lock:
        return _open.get(key, 0)


def release_when_done(request, release: Callable[[], None]) -> None:
    """Run `release` once `request`'s answer is finished: when its response is closed (ReleaseOnCloseMiddleware),
    and at the latest when the ASGI server is done with the request (InFlightMiddleware)."""
    scope = getattr(request, "scope", None)
    if isinstance(scope, dict) and SCOPE_KEY in scope:
        scope[SCOPE_KEY].append(release)
    request.__dict__.setdefault("_inflight_releases", []).append(release)


class ReleaseOnCloseMiddleware:
    """Django middleware, first in the list (it sees the response that goes out): the request's releases run when
    that response is closed, after its last part is sent (any server, the test client)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        releases = request.__dict__.pop("_inflight_releases", None)
        if releases:
            response._resource_closers.extend(releases)
        return response


class InFlightMiddleware:
    """ASGI middleware in front of Django: the request's releases run when the server is done with it, also where
    Django closed no response (a send to a client gone raised). Django's handler returns only once the view's
    thread has (asgiref waits for it), so a long poll keeps its place while it waits."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        releases: list = []
        scope[SCOPE_KEY] = releases
        try:
            await self.app(scope, receive, send)
        finally:
            for release in releases:
                release()
