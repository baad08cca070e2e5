"""Request bodies over the limit are refused before the server reads them: against the live web server
as deployed (uvicorn + the ASGI app), an anonymous 20 MB POST to the login page is answered 413 after
the client has sent only its first megabyte, with or without a Content-Length."""
from __future__ import annotations

import http.client
import os

import pytest
from django.conf import settings

from tests.dashboard import servers

MB = 1024 * 1024


@pytest.fixture(scope="module")
def web():
    env = servers.child_env(os.environ.get("DATABASE_URL", "sqlite:////tmp/unused.sqlite3"),
                            os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    proc, url = servers.start_web(env, os.environ.get("WEB_SERVER", "uvicorn"))
    try:
        yield url
    finally:
        proc.stop()


def _send_partial(url: str, headers: dict, first: bytes, chunked: bool) -> tuple[int, bytes]:
    """Send the headers and only the first part of the body, then read the answer."""
    host, port = url.rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/accounts/login/")
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders()
    sock = conn.sock
    try:
        if chunked:
            for i in range(0, len(first), 64 * 1024):
                part = first[i:i + 64 * 1024]
                sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        else:
            sock.sendall(first)
    except (BrokenPipeError, ConnectionResetError):
        pass
    resp = conn.getresponse()  # would block until timeout if the server waited for the rest
    body = resp.read()
    conn.close()
    return resp.status, body


@pytest.mark.e2e
def test_declared_20mb_post_refused_before_the_body_is_sent(web):
    status, body = _send_partial(web, {"Content-Type": "application/x-www-form-urlencoded",
                                       "Content-Length": str(20 * MB)}, b"a=" + b"x" * MB, chunked=False)
    assert status == 413
    assert b"too large" in body


@pytest.mark.e2e
def test_chunked_body_cut_off_once_past_the_limit(web):
    limit = settings.REQUEST_MAX_BODY_BYTES
    status, _ = _send_partial(web, {"Content-Type": "application/x-www-form-urlencoded",
                                    "Transfer-Encoding": "chunked"}, b"a=" + b"x" * (limit + 256 * 1024), chunked=True)
    assert status == 413


@pytest.mark.e2e
def test_small_login_post_still_reaches_django(web):
    host, port = web.rsplit("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/accounts/login/", body=b"username=a&password=b",
                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert conn.getresponse().status == 403  # CSRF: Django saw it


def test_large_limit_only_for_uploads_with_credentials(settings):
    from controlplane.bodylimit import body_limit

    settings.REQUEST_MAX_BODY_BYTES = 100
    settings.UPLOAD_MAX_BODY_BYTES = 10_000
    upload = {"path": "/api/datasets/", "headers": []}
    assert body_limit(upload) == 100
    assert body_limit({**upload, "headers": [(b"authorization", b"Token x")]}) == 10_000
    assert body_limit({**upload, "headers": [(b"cookie", b"sessionid=abc")]}) == 10_000
    assert body_limit({"path": "/accounts/login/", "headers": [(b"authorization", b"Token x")]}) == 100
