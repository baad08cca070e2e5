"""The engine runs verifiers by kind with the result cache, and its ticks tell the diagnosis about the
verification pool, queue and cache."""
from __future__ import annotations

import pytest
from workers.diagnosis.evidence import build_evidence
from workers.diagnosis.classifier import diagnose
from workers.engine.runner import run_collection
from workers.engine.types import TaskItem
from workers.telemetry.collector import tick_to_dict

from .test_engine import ListSink, spec_for


def _items(n_tasks, repeats):
    rows = [{"responses_create_params": {"input": f"What is {i} + 1?"}, "expected_answer": str(i + 1)}
            for i in range(n_tasks)]
    return [TaskItem(t, r, rows[t]) for t in range(n_tasks) for r in range(repeats)]


@pytest.mark.slow
async def test_pooled_verifier_with_cache_feeds_the_diagnosis(simulator_factory):
    sim = simulator_factory(seed=4, math_accuracy=0.5)
    sink = ListSink()
    # 4 output tokens: "The answer is \\boxed{N}": repeats of a task often give the same response
    spec = spec_for(sim, parallelism=16, verifier="math", verify_processes=2, verify_cache="job",
                    responses_create_params={"max_output_tokens": 4})
    summary = await run_collection(spec, _items(20, 10), sink)
    assert summary.completed == 200 and not summary.fatal_error
    assert all(r.reward == (1.0 if r.output_row["extracted_answer"] == r.output_row["expected_answer"] else 0.0)
               for r in sink.results)
    last = sink.ticks[-1].extra
    assert last["verify_kind"] == "cpu" and last["verify_pool_size"] == 2 and last["verify_cache_lookups"] == 200
    distinct = len({(r.task_index, r.output_row["response"]["output"][0]["content"][0]["text"]) for r in sink.results})
    assert last["verify_cache_hits"] == 200 - distinct > 0
    ev = build_evidence([tick_to_dict(t) for t in sink.ticks])
    assert ev.verify_cache_hit_rate == (200 - distinct) / 200
    assert ev.verify_pool_utilization is not None and 0 <= ev.verify_pool_utilization <= 1
    assert ev.verify_queue_mean is not None
    names = {e.name for e in diagnose(ev).evidence_items}
    assert {"verify_pool_utilization", "verify_queue_mean", "verify_cache_hit_rate"} <= names


@pytest.mark.slow
async def test_io_verifier_runs_in_threads_and_cache_off_computes_everything(simulator_factory):
    sim = simulator_factory(seed=4)
    sink = ListSink()
    spec = spec_for(sim, parallelism=8, verifier="tests.verifier_plugins.Length", verifier_options={"min_words": 2},
                    verify_cache="off", responses_create_params={"max_output_tokens": 4})
    summary = await run_collection(spec, _items(5, 4), sink)
    assert summary.completed == 20 and all(r.reward == 1.0 and r.output_row["words"] >= 2 for r in sink.results)
    assert sink.ticks[-1].extra["verify_cache_lookups"] == 0


async def test_bad_verifier_options_stop_the_run_with_a_clear_error(simulator):
    sink = ListSink()
    spec = spec_for(simulator, verifier="mcqa", verifier_options={"grading_mode": "vibes"})
    summary = await run_collection(spec, _items(2, 1), sink)
    assert "grading_mode must be one of" in summary.fatal_error and not sink.results
