"""The verifier registry users extend, multiple choice, the LLM judge (against the simulator) and the
result cache."""
from __future__ import annotations

import asyncio

import pytest

from workers.verifiers import get_verifier, missing_fields, verify_row
from workers.verifiers.execution import VerifyExecutor
from workers.verifiers.judge import JudgeError
from workers.verifiers.registry import describe_missing

MC = [{"A": "Paris"}, {"B": "Lyon"}, {"C": "Nice"}, {"D": "Lille"}]


def test_dotted_path_function_and_class_follow_the_builtin_contract():
    fn = get_verifier("tests.verifier_plugins:last_word")
    assert fn.effective_kind == "cpu" and fn.required() == ("expected_answer",)
    assert fn.validate_options({}) == {"suffix": ""}
    res = verify_row("tests.verifier_plugins:last_word", {"expected_answer": "7"}, "so it is 7.", {"suffix": "."})
    assert res.reward == 1.0 and res.fields == {"last_word": "7"}
    cls = get_verifier("tests.verifier_plugins.Length")
    assert verify_row("tests.verifier_plugins.Length", {}, "one two", {"min_words": 2}).reward == 1.0
    assert cls.info()["options"] == {"min_words": {"type": "int", "default": 3}}


@pytest.mark.parametrize("name, message", [
    ("tests.verifier_plugins:not_marked", "must be a Verifier subclass or a function marked"),
    ("os:system", "must be a Verifier subclass or a function marked"),
    ("no_such_module_xyz:thing", "cannot import module"),
    ("tests.verifier_plugins:missing", "has no 'missing'"),
    ("nonsense", "unknown verifier 'nonsense'"),
])
def test_bad_names_are_clear_errors(name, message):
    with pytest.raises(ValueError, match=message):
        get_verifier(name)


def test_options_are_validated():
    v = get_verifier("code")
    with pytest.raises(ValueError, match="unknown option 'timeout'.*option 'memory_mb' must be int"):
        v.validate_options({"timeout": 3, "memory_mb": "lots"})
    assert v.validate_options({"wall_s": 3})["wall_s"] == 3.0
    with pytest.raises(ValueError, match="grading_mode must be one of"):
        get_verifier("mcqa").validate_options({"grading_mode": "vibes"})
    with pytest.raises(ValueError, match="base_url"):
        get_verifier("judge").validate_options({})


def test_required_fields_report_line_numbers():
    rows = [(1, {"options": MC, "expected_answer": "A"}), (2, {"expected_answer": "B"}), (5, {"options": MC}),
            (9, {"verifier_metadata": {}})]
    count, report = missing_fields(get_verifier("mcqa").required(), rows)
    assert count == 3 and [r["line"] for r in report] == [2, 5, 9]
    assert report[0]["missing"] == ["options"] and report[2]["missing"] == ["options", "expected_answer"]
    assert "line 2: options; line 5: expected_answer" in describe_missing("mcqa", count, report)
    count, report = missing_fields(get_verifier("code").required(), rows)
    assert count == 4 and report[3] == {"line": 9, "missing": ["verifier_metadata.unit_tests"]}
    # an answer_field option renames the field that is required
    assert get_verifier("exact").required({"answer_field": "gold"}) == ("gold",)


@pytest.mark.parametrize("text, mode, letter", [
    ("Let me think... The answer is (B).", "free_text", "B"),
    ("Answer: C", "free_text", "C"),
    ("I pick \\boxed{D} in the end", "free_text", "D"),
    ("It must be Lyon.\n\nB", "free_text", "B"),
    ("\\boxed{Lyon}", "free_text", "B"),
    ("\\boxed{ [C] }", "strict_single_letter_boxed", "C"),
    ("The answer is C", "strict_single_letter_boxed", ""),
    ("\\boxed{AB}", "strict_single_letter_boxed", ""),
    ("\\boxed{Nice}", "lenient_boxed", "C"),
    ("answer: lille", "lenient_answer_colon", "D"),
    ("the answer is (E)", "free_text", ""),  # not an option
])
def test_multiple_choice_extracts_the_letter(text, mode, letter):
    res = verify_row("mcqa", {"options": MC, "expected_answer": letter or "A", "grading_mode": mode}, text)
    assert res.fields["extracted_answer"] == letter
    assert res.reward == (1.0 if letter else 0.0)


def _judge_row(q="What is 2 + 3?"):
    return {"question": q, "expected_answer": "5", "responses_create_params": {"input": q}}


@pytest.mark.slow
async def test_judge_against_the_simulator_parses_verdicts(simulator_factory):
    sim = simulator_factory(math_accuracy=1.0, seed=1)
    # the simulator answers arithmetic with \boxed{N}: "0 + 1" -> verdict 1, "0 + 0" -> verdict 0
    yes = {"base_url": sim.url, "model": sim.model, "prompt_template": "Grade {response} vs {expected_answer}. What is 0 + 1?"}
    no = {**yes, "prompt_template": "Grade {response} vs {expected_answer}. What is 0 + 0?"}
    ex_yes, ex_no = VerifyExecutor("judge", yes, cache="off"), VerifyExecutor("judge", no, cache="off")
    try:
        r1, r0 = await asyncio.gather(ex_yes.verify(_judge_row(), "5"), ex_no.verify(_judge_row(), "4"))
    finally:
        await ex_yes.aclose()
        await ex_no.aclose()
    assert r1.reward == 1.0 and r0.reward == 0.0 and "\\boxed{1}" in r1.fields["judge_verdict"]
    bad = VerifyExecutor("judge", {**yes, "prompt_template": "Say something about {response}"}, cache="off")
    try:
        with pytest.raises(JudgeError, match="unparseable"):
            await bad.verify(_judge_row(), "5")
        with pytest.raises(JudgeError, match="names 'gold'"):
            await VerifyExecutor("judge", {**yes, "prompt_template": "{gold}"}, cache="off").verify(_judge_row(), "5")
    finally:
        await bad.aclose()


@pytest.mark.slow
async def test_judge_retries_faults_times_out_and_keeps_its_own_concurrency(simulator_factory):
    sim = simulator_factory(math_accuracy=1.0, seed=2, ttft_ms=150, fault_rates={"500": 0.3})
    opts = {"base_url": sim.url, "model": sim.model, "prompt_template": "{response} What is 0 + 1?",
            "concurrency": 3, "max_retries": 8, "timeout_s": 20}
    ex = VerifyExecutor("judge", opts, cache="off")
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, ex.running)
            await asyncio.sleep(0.01)

    w = asyncio.ensure_future(watch())
    try:
        results = await asyncio.gather(*(ex.verify(_judge_row(), f"r{i}") for i in range(12)))
    finally:
        w.cancel()
        await ex.aclose()
    assert [r.reward for r in results] == [1.0] * 12
    assert any(r.fields["judge_attempts"] > 1 for r in results)  # 500s were retried
    assert peak == 3
    # a judge that never answers: bounded by timeout_s x attempts, then a clear error
    stall = simulator_factory(fault_rates={"stall": 1.0})
    ex = VerifyExecutor("judge", {**opts, "base_url": stall.url, "timeout_s": 0.5, "max_retries": 1}, cache="off")
    try:
        with pytest.raises(JudgeError, match="unreachable after 2 attempts: no answer in time"):
            await asyncio.wait_for(ex.verify(_judge_row(), "x"), 30)
    finally:
        await ex.aclose()


async def test_cache_computes_identical_work_once():
    calls = []
    ex = VerifyExecutor("tests.verifier_plugins:last_word", {}, cache="job")
    orig = ex.verifier.fn

    def counting(row, text, options):
        calls.append(text)
        return orig(row, text, options)

    ex.verifier.fn = counting
    try:
        rows = [({"expected_answer": str(i % 10), "_ng_rollout_index": i}, f"answer {i % 20}") for i in range(200)]
        results = await asyncio.gather(*(ex.verify(r, t) for r, t in rows))
    finally:
        ex.verifier.fn = orig
    assert [r.reward for r in results] == [1.0 if (i % 20) == (i % 10) else 0.0 for i in range(200)]
    assert len(calls) == 20 and ex.lookups == 200 and ex.hits == 180
    off = VerifyExecutor("exact", {}, cache="off")
    await off.verify({"expected_answer": "1"}, "1")
    assert off.lookups == 0
