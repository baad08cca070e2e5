"""IndexRuns (workers/task_index.py): a chunk's task indices as runs of consecutive values, the same answers as
a set in constant memory for the usual ascending, contiguous chunk (ChunkTasks' completeness check)."""
from __future__ import annotations

import random
import tracemalloc

from workers.task_index import IndexRuns


def test_same_members_as_a_set_in_any_order():
    rng = random.Random(0)
    for _ in range(500):
        values = [rng.randrange(60) for _ in range(rng.randrange(80))]
        runs, expected = IndexRuns(values), set(values)
        assert list(runs) == sorted(expected) and len(runs) == len(expected) and bool(runs) == bool(expected)
        assert all((i in runs) == (i in expected) for i in range(-2, 65))
        ranges = runs.ranges()
        assert all(a[1] + 1 < b[0] for a, b in zip(ranges, ranges[1:]))  # disjoint, not touching, ascending


def test_a_contiguous_chunk_is_one_run_in_constant_memory():
    tracemalloc.start()
    try:
        runs = IndexRuns(range(1_000_000, 1_250_000))
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert runs.ranges() == [(1_000_000, 1_249_999)] and len(runs) == 250_000
    assert used < 10_000  # a set of these indices: ~18 MB
