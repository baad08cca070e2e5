"""Exact and normalized string match against `expected_answer`."""
import re
import unicodedata

from .base import Verifier, VerifyResult, register

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def extract_final_answer(text: str) -> str:
    """The last \\boxed{...} if present, else the last non-empty line."""
    boxed = _BOXED.findall(text or "")
    if boxed:
        return boxed[-1]
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFKC", str(text)).strip().lower()
    text = re.sub(r"\s+", " ", text)
    return text.strip(" .,:;!\"'`$")


@register
class ExactMatch(Verifier):
    name = "exact"
    kind = "cpu"  # cheap, but sync: run where a CPU verifier runs
    options = {"answer_field": (str, "expected_answer"), "extract": (bool, True)}

    def verify(self, row, response_text, options):
        expected = str(row.get(options.get("answer_field", "expected_answer"), ""))
        extracted = extract_final_answer(response_text) if options.get("extract", True) else (response_text or "")
        return VerifyResult(reward=1.0 if extracted.strip() == expected.strip() else 0.0, fields={"extracted_answer": extracted})


@register
class NormalizedMatch(Verifier):
    name = "normalized"
    kind = "cpu"
    options = {"answer_field": (str, "expected_answer")}

    def verify(self, row, response_text, options):
        expected = str(row.get(options.get("answer_field", "expected_answer"), ""))
        extracted = extract_final_answer(response_text)
        return VerifyResult(reward=1.0 if normalize(extracted) == normalize(expected) else 0.0, fields={"extracted_answer": extracted})
