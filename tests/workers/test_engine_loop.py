"""The engine on the event loop ENGINE_EVENT_LOOP names (workers.engine.loop): uvloop runs a collection to
the same rows as asyncio's loop; an unknown name is refused with the choices."""
from __future__ import annotations

import asyncio

import pytest

from tests.workers.test_engine import ListSink, math_rows, spec_for
from workers.engine.loop import loop_factory, run
from workers.engine.runner import run_collection
from workers.engine.types import TaskItem


class LoopSink(ListSink):
    async def rollout(self, result):
        self.loop_type = type(asyncio.get_running_loop()).__module__
        await super().rollout(result)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_collection_on_each_loop_stores_every_row(simulator, loop):
    pytest.importorskip("uvloop") if loop == "uvloop" else None
    sink = LoopSink()
    tasks = [TaskItem(i, 0, row) for i, row in math_rows(40)]
    summary = run(run_collection(spec_for(simulator, parallelism=8, verifier="math"), tasks, sink), loop)
    assert summary.completed + summary.failed == 40 and not summary.fatal_error
    assert sorted(sink.by_index()) == [(i, 0) for i in range(40)]
    assert sink.loop_type.startswith("uvloop" if loop == "uvloop" else "asyncio")


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="asyncio or uvloop"):
        loop_factory("trio")
