"""Aggregate metrics, pass@k / majority@k, timing percentiles, materialization helpers."""
import math
import statistics
import tracemalloc

import pytest

from workers.engine.aggregate import AggregateAccumulator, TimingAccumulator, pass_at_k, timing_percentiles
from workers.engine.materialize import materialize, merge_overrides
from workers.engine.types import RolloutResult


def _row(task, rollout, reward, answer=None, out_tokens=10, extra=None):
    row = {"responses_create_params": {"input": "q", "temperature": 1.0}, "_ng_task_index": task,
           "_ng_rollout_index": rollout, "reward": reward,
           "response": {"usage": {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 1},
                                  "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                                  "total_tokens": 5 + out_tokens}}}
    if answer is not None:
        row["extracted_answer"] = answer
    row.update(extra or {})
    return row


def test_numeric_fields_stats():
    rows = [_row(0, 0, 1.0, out_tokens=10, extra={"library_reward": 1.0, "flag": True, "name": "x"}),
            _row(1, 0, 0.0, out_tokens=20, extra={"library_reward": 0.0}),
            _row(2, 0, 1.0, out_tokens=60, extra={"library_reward": 1.0})]
    res = AggregateAccumulator().add_many(rows).result()
    assert res["num_rows"] == 3 and res["num_tasks"] == 3
    assert res["mean/reward"] == pytest.approx(2 / 3)
    assert res["std/reward"] == pytest.approx(statistics.pstdev([1, 0, 1]))
    assert res["median/output_tokens"] == 20 and res["min/output_tokens"] == 10 and res["max/output_tokens"] == 60
    assert res["mean/total_tokens"] == pytest.approx(35) and res["mean/cached_tokens"] == 1
    assert res["mean/library_reward"] == pytest.approx(2 / 3)
    assert "mean/flag" not in res and "mean/_ng_task_index" not in res and "mean/temperature" not in res
    assert res["pass@1"] == pytest.approx(2 / 3)
    assert not any(k.startswith("majority@") for k in res)  # no repeats


def test_pass_at_k_and_majority_with_repeats():
    acc = AggregateAccumulator()
    # task 0: 1 of 4 correct; majority answer "3" is wrong
    for i, (r, a) in enumerate([(0, "3"), (0, "3"), (1, "4"), (0, "5")]):
        acc.add(_row(0, i, float(r), a))
    # task 1: 3 of 4 correct; majority right
    for i, (r, a) in enumerate([(1, "7"), (1, "7"), (0, "8"), (1, "7")]):
        acc.add(_row(1, i, float(r), a))
    res = acc.result()
    assert res["pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert res["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 3, 2)) / 2)
    assert res["pass@4"] == 1.0
    assert res["majority@4"] == 0.5


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_memory_is_per_value_not_per_row():
    acc = AggregateAccumulator()
    for i in range(2000):
        acc.add(_row(i, 0, 1.0))
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    for i in range(2000, 22000):
        acc.add(_row(i % 2000, 1, 0.0))  # repeats of existing tasks: only numbers are kept
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
    tracemalloc.stop()
    # 20k rows x 6 numeric fields x 8 bytes ~ 1 MB (+ array over-allocation); the rows themselves are far bigger
    assert grown < 3_000_000, grown


def test_timing_percentiles_and_accumulator():
    p = timing_percentiles(range(1, 101))
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert timing_percentiles([]) == {"p50": None, "p90": None, "p99": None}
    acc = TimingAccumulator()
    acc.add(RolloutResult(0, 0, True, {}, queue_ms=1.0, ttft_ms=10.0, generation_ms=None, verify_ms=2.0, wall_ms=20.0))
    acc.add(queue_ms=3.0, ttft_ms=30.0, wall_ms=40.0)
    res = acc.result()
    assert res["queue_ms"]["mean"] == 2.0 and res["ttft_ms"]["p50"] == 20.0
    assert res["generation_ms"]["count"] == 0 and res["generation_ms"]["p50"] is None
    assert res["wall_ms"]["max"] == 40.0


def test_materialize_order_and_indices():
    rows = [(0, {"q": "a"}), (1, {"q": "b", "_ng_task_index": 17}), (2, {"q": "c"})]
    items = list(materialize(iter(rows), 2))
    assert [(t.task_index, t.rollout_index, t.row["q"]) for t in items] == [
        (0, 0, "a"), (0, 1, "a"), (17, 0, "b"), (17, 1, "b"), (2, 0, "c"), (2, 1, "c")]
    with pytest.raises(ValueError):
        list(materialize([(0, {})], 0))
    with pytest.raises(ValueError, match="_ng_task_index"):
        list(materialize([(0, {"_ng_task_index": "x"})], 1))


def test_materialize_is_lazy():
    def endless():
        i = 0
        while True:
            yield i, {"i": i}
            i += 1
    gen = materialize(endless(), 3)
    assert [next(gen).task_index for _ in range(7)] == [0, 0, 0, 1, 1, 1, 2]


def test_merge_overrides_deep_and_does_not_mutate():
    row = {"responses_create_params": {"input": "x", "temperature": 0.2, "metadata": {"a": 1, "b": 2}}, "k": 1}
    out = merge_overrides(row, {"temperature": 1.0, "max_output_tokens": 9, "metadata": {"b": 3}})
    assert out["responses_create_params"] == {"input": "x", "temperature": 1.0, "max_output_tokens": 9, "metadata": {"a": 1, "b": 3}}
    assert row["responses_create_params"] == {"input": "x", "temperature": 0.2, "metadata": {"a": 1, "b": 2}}
    assert merge_overrides(row, {}) is row
    assert merge_overrides({"k": 1}, {"temperature": 0})["responses_create_params"] == {"temperature": 0}


def test_ordered_by_task_folds_tasks_and_gives_the_same_metrics():
    import random

    rng = random.Random(3)
    rows = []
    for task in range(500):
        for rep in range(4):
            answer = str(rng.choice([task, task + 1]))
            rows.append({"_ng_task_index": task, "_ng_rollout_index": rep, "reward": float(answer == str(task)),
                         "extracted_answer": answer})
    unordered = AggregateAccumulator().add_many(rows)
    ordered = AggregateAccumulator(ordered_by_task=True)
    most_open = 0
    for row in rows:
        ordered.add(row)
        most_open = max(most_open, len(ordered.groups))
    assert most_open == 1  # one task open at a time: memory does not grow with the number of tasks
    a, b = unordered.result(), ordered.result()
    assert a.keys() == b.keys() and {"pass@1", "pass@2", "pass@4", "majority@4", "num_tasks"} <= a.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key]), key
