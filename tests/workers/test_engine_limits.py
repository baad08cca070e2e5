"""A model server cannot make a worker read an unbounded answer, nor send it somewhere else."""
from __future__ import annotations

import pytest
from aiohttp import web

from workers.engine.materialize import materialize
from workers.engine.runner import run_collection
from workers.engine.types import FailureClass

from .test_engine import ListSink, math_rows, spec_for


@pytest.mark.parametrize("stream", [True, False])
async def test_answer_over_the_size_cap_fails_as_bad_response(simulator, stream):
    sink = ListSink()
    spec = spec_for(simulator, max_response_bytes=300, max_retries=0, stream=stream,
                    responses_create_params={"max_output_tokens": 40})
    summary = await run_collection(spec, materialize(math_rows(3), 1), sink)
    assert summary.failed == 3 and summary.completed == 0
    assert all(r.failure_class == FailureClass.BAD_RESPONSE and "over 300 bytes" in r.error for r in sink.results)
    # the same server under the default cap: every row succeeds
    sink = ListSink()
    assert (await run_collection(spec_for(simulator, stream=stream), materialize(math_rows(3), 1), sink)).completed == 3


async def test_redirect_is_not_followed(unused_tcp_port):
    hits = []

    async def redirect(request):
        raise web.HTTPTemporaryRedirect("/internal")

    async def internal(request):
        hits.append(request.path)
        return web.json_response({"secret": "internal page"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", redirect)
    app.router.add_route("*", "/internal", internal)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        class Srv:
            url, model = f"http://127.0.0.1:{unused_tcp_port}", "m"

        sink = ListSink()
        summary = await run_collection(spec_for(Srv, max_retries=0), materialize(math_rows(2), 1), sink)
        assert summary.failed == 2 and hits == []
        assert all("HTTP 307" in r.error and "internal page" not in r.error for r in sink.results)
    finally:
        await runner.cleanup()
