"""Math verification with math-verify (as NeMo Gym's library_judge_math does).

CPU-bound (sympy): the engine runs it in a process pool. math-verify's own timeouts use signals,
which work only in a process's main thread: they are enabled only there.
"""
import threading

from .base import Verifier, VerifyResult, register
from .match import extract_final_answer, normalize


def _in_main_thread():
    return threading.current_thread() is threading.main_thread()


@register
class MathVerifier(Verifier):
    name = "math"
    kind = "cpu"
    options = {"answer_field": (str, "expected_answer")}

    def verify(self, row, response_text, options):
        from math_verify import parse, verify

        expected = str(row.get(options.get("answer_field", "expected_answer"), ""))
        timeout = 5 if _in_main_thread() else None
        gold = parse(expected if "$" in expected or "\\boxed" in expected else f"${expected}$", parsing_timeout=timeout)
        answer = parse(response_text or "", parsing_timeout=timeout)
        ok = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=timeout)
        extracted = str(answer[-1]) if answer else ""
        return VerifyResult(reward=1.0 if ok else 0.0, fields={"extracted_answer": extracted, "library_reward": 1.0 if ok else 0.0})

    def fast_verify(self, row, response_text, options):
        """Heuristic for `fast` mode: compare the last boxed answer as a normalized string."""
        expected = str(row.get(options.get("answer_field", "expected_answer"), ""))
        extracted = extract_final_answer(response_text)
        return VerifyResult(reward=1.0 if normalize(extracted) == normalize(expected) else 0.0, fields={"extracted_answer": extracted})
