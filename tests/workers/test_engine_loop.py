"""The engine on the event loop ENGINE_EVENT_LOOP names (workers.engine.loop): uvloop runs a collection to
the same rows as asyncio's loop; an unknown name is refused with the choices."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.fixtures_simulator import serve_locally
from tests.workers.test_engine import ListSink, math_rows, spec_for
from workers.engine.loop import loop_factory, run
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, EndpointSpec, TaskItem


class LoopSink(ListSink):
    async def rollout(self, result):
        self.loop_type = type(asyncio.get_running_loop()).__module__
        await super().rollout(result)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_collection_on_each_loop_stores_every_row(simulator, loop):
    pytest.importorskip("uvloop") if loop == "uvloop" else None
    sink = LoopSink()
    tasks = [TaskItem(i, 0, row) for i, row in math_rows(40)]
    summary = run(run_collection(spec_for(simulator, parallelism=8, verifier="math"), tasks, sink), loop)
    assert summary.completed + summary.failed == 40 and not summary.fatal_error
    assert sorted(sink.by_index()) == [(i, 0) for i in range(40)]
    assert sink.loop_type.startswith("uvloop" if loop == "uvloop" else "asyncio")


def test_uvloop_is_the_default_and_asyncio_can_be_chosen(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("ENGINE_EVENT_LOOP", raising=False)
    assert loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv("ENGINE_EVENT_LOOP", "asyncio")
    assert loop_factory() is None


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="asyncio or uvloop"):
        loop_factory("trio")


def test_streamed_requests_reuse_their_connections():
    """A stream's chunked body ends in a read after `[DONE]` here (the server waits before closing it): the
    engine still reads that end, so a run opens about one connection per slot, not one per request (at
    thousands of requests in flight, a new TCP connection per request cost more CPU than the request)."""
    from aiohttp import web

    peers = set()

    async def completions(request):
        await request.json()
        peers.add(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        for chunk in ({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "4"},
                                            "finish_reason": None}]},
                      {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)  # the body's terminating chunk comes in a later read
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        async with serve_locally(app) as url:
            spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[url], model="m"),
                                  parallelism=3, verifier="exact", stream=True)
            rows = [TaskItem(i, 0, {"responses_create_params": {"input": "2+2?"}, "expected_answer": "4"})
                    for i in range(30)]
            return await run_collection(spec, rows, ListSink())

    summary = asyncio.run(main())
    assert summary.completed == 30 and not summary.fatal_error
    assert len(peers) <= 3, f"{len(peers)} connections for 30 streamed requests at parallelism 3"


def test_collector_tuning_lasts_until_the_last_concurrent_run_ends():
    """Runs in a worker's thread pool overlap: the collector's settings (the process's) come back when the last
    one ends, not when the first does."""
    import gc
    import threading

    from workers.engine.loop import RUN_GC_THRESHOLD0, collector_tuned

    before = gc.get_threshold()
    first_in, second_done = threading.Event(), threading.Event()
    seen = {}

    def other_run():
        with collector_tuned():
            first_in.set()
            second_done.wait(5)
            seen["after the first ended"] = gc.get_threshold()[0]

    t = threading.Thread(target=other_run)
    t.start()
    first_in.wait(5)
    with collector_tuned():
        seen["during both"] = gc.get_threshold()[0]
        assert gc.get_freeze_count() > 0
    second_done.set()
    t.join(5)
    assert seen == {"during both": RUN_GC_THRESHOLD0, "after the first ended": RUN_GC_THRESHOLD0}
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
