"""The outbound gate's own rules (workers/outbound.py): allow-list entries, URL checks, resolved addresses, the
byte cap and what error texts keep apart (workers/disclosure.py). Calls go to servers on 127.0.0.1."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from workers import outbound
from workers.disclosure import public, with_detail
from workers.outbound import OutboundPolicy, OutboundRefused, ResponseTooLarge


def refused(url, *allow) -> str | None:
    try:
        outbound.check_url(url, OutboundPolicy(allow=allow or ("*",)))
    except OutboundRefused as exc:
        return exc.reason
    return None


def test_allow_list_entries_are_host_port_pairs_names_domains_and_networks():
    assert refused("http://vllm:8000/v1", "vllm:8000") is None
    assert "not an allowed host" in refused("http://vllm:6379", "vllm:8000")
    assert refused("http://vllm:6379", "vllm") is None  # a bare host: any port (the old entries keep working)
    assert refused("http://gym:11005", "gym:11000-11100") is None and refused("http://gym:10999", "gym:11000-11100")
    assert refused("https://a.gpu.example", ".gpu.example:443") is None and refused("http://evilgpu.example", ".gpu.example")
    assert refused("http://10.1.2.3:8000", "10.0.0.0/8:8000") is None and refused("http://10.1.2.3:9000", "10.0.0.0/8:8000")
    assert refused("http://[::1]:8000", "[::1]:8000") is None
    with pytest.raises(ValueError, match="bad allow-list entry 'vllm:port'"):
        OutboundPolicy(allow=("vllm:port",))


@pytest.mark.parametrize("url, why", [
    ("ftp://example.com/x", "http(s)"), ("http://user:pw@example.com/", "credentials"), ("http:///x", "http(s)"),
    ("http://169.254.169.254/latest", "metadata"), ("http://[::ffff:169.254.169.254]/", "metadata"),
    ("http://[fe80::1]:80/", "link-local"), ("http://metadata.google.internal/", "metadata"),
    ("http://224.0.0.1/", "unicast"), ("http://0.0.0.0:80/", "unicast"),
])
def test_urls_never_called_whatever_the_allow_list(url, why):
    assert why in (refused(url, "*") or ""), refused(url, "*")


def test_a_name_admitted_by_address_is_checked_on_what_it_resolves_to():
    nets = OutboundPolicy(allow=("10.0.0.0/8",))
    assert outbound.url_problem("http://localhost:80", nets) == "localhost resolves to 127.0.0.1:80, not an allowed " \
                                                                 "address (ENDPOINT_ALLOWED_HOSTS)"
    assert outbound.url_problem("http://localhost:80", OutboundPolicy(allow=("127.0.0.0/8",))) is None
    assert "cloud metadata" in outbound.url_problem("http://2852039166/", OutboundPolicy())  # 169.254.169.254


@pytest.fixture
async def server():
    async def big(request):
        return web.Response(body=b"x" * 5000)

    async def stream(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(10):
            await resp.write(b"y" * 1000)
        return resp

    async def redirect(request):
        raise web.HTTPFound("/big")

    app = web.Application()
    app.router.add_get("/big", big)
    app.router.add_get("/stream", stream)
    app.router.add_get("/redirect", redirect)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


async def test_answers_are_capped_however_they_are_read_and_redirects_are_answers(server):
    async with outbound.gated_session() as s:
        async with s.get(f"{server}/big", max_bytes=3000) as resp:  # Content-Length over the cap: status readable
            assert resp.status == 200
            with pytest.raises(ResponseTooLarge, match="5000 announced"):
                await resp.read()
        for read in ("read", "iter_any", "iter_chunked"):
            async with s.get(f"{server}/stream", max_bytes=3000) as resp:
                with pytest.raises(ResponseTooLarge, match="over 3000 bytes"):
                    if read == "read":
                        await resp.content.read()
                    else:
                        args = (512,) if read == "iter_chunked" else ()
                        async for _ in getattr(resp.content, read)(*args):
                            pass
        async with s.get(f"{server}/stream", max_bytes=10_000) as resp:
            assert len(await resp.read()) == 10_000
        async with s.get(f"{server}/redirect") as resp:
            assert resp.status == 302
        with pytest.raises(ValueError, match="no redirect"):
            async with s.get(f"{server}/redirect", allow_redirects=True):
                pass
    with pytest.raises(OutboundRefused):
        await outbound.fetch("GET", f"{server}/big", policy=OutboundPolicy(allow=("vllm:8000",)))


async def test_a_non_http_answer_is_described_without_quoting_it():
    async def banner(reader, writer):
        await reader.read(100)
        writer.write(b"SSH-2.0-OpenSSH_9.2 secret-banner\r\n")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(banner, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/"
    try:
        with pytest.raises(outbound.OutboundError) as err:
            await outbound.fetch("GET", url, timeout_s=5)
    finally:
        srv.close()
    e = err.value
    assert e.failure_class == "connection" and e.retryable and e.reason == "not an HTTP answer"
    assert "secret-banner" in e.detail and "secret-banner" in str(e) and public(str(e)) == "not an HTTP answer"


def test_what_a_server_said_is_kept_apart_from_the_products_words():
    text = with_detail("HTTP 500 from http://x:1/v1/chat/completions after 2 retries", b"<html>internal</html>")
    assert public(text) == "HTTP 500 from http://x:1/v1/chat/completions after 2 retries" and "internal" in text
    assert with_detail("cannot connect: Connection refused", "") == "cannot connect: Connection refused"
    # texts stored before the convention
    assert public("HTTP 503 from http://127.0.0.1:8000/v1/chat/completions: upstream body") == \
        "HTTP 503 from http://127.0.0.1:8000/v1/chat/completions"
    assert public("judge answered HTTP 403: forbidden page") == "judge answered HTTP 403"
    assert public("internal engine error: ClientResponseError: 400, message='Bad status line SSH-2.0'") == \
        "internal engine error: ClientResponseError: 400"
