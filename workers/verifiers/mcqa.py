"""Multiple choice (NeMo Gym's mcqa fields): `options` [{"A": "text"}, ...], `expected_answer` (the
letter), optional per-row `grading_mode`.

Grading modes (the row's `grading_mode`, else the `grading_mode` option):
* strict_single_letter_boxed (NeMo Gym's default): exactly one allowed letter inside the last \\boxed{}.
* lenient_boxed: the boxed letter, else the boxed text matching exactly one option's text.
* lenient_answer_colon: what follows the last "Answer:" — a letter, or one option's text.
* free_text: \\boxed{} first, then "Answer: X" / "the answer is (X)" / "option X", then the last
  standalone letter in parentheses or on a line of its own.
"""
from __future__ import annotations

import re

from .base import Verifier, VerifyResult, register
from .match import normalize

MODES = ("strict_single_letter_boxed", "lenient_boxed", "lenient_answer_colon", "free_text")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_COLON = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)
_ANSWER_IS = re.compile(r"(?:answer|option|choice)\s+(?:is\s+)?(?:option\s+)?[\(\[]?([A-Za-z])[\)\]]?(?![A-Za-z])",
                        re.IGNORECASE)
_PAREN = re.compile(r"[\(\[]([A-Z])[\)\]]")
_LINE_LETTER = re.compile(r"^\s*\**\s*([A-Z])\s*[\.\):]?\s*\**\s*$", re.MULTILINE)


def parse_options(options) -> dict[str, str]:
    """{"A": "text", ...} from NeMo Gym's list of one-key dicts (or a plain dict)."""
    out: dict[str, str] = {}
    if isinstance(options, dict):
        items = options.items()
    else:
        items = [kv for d in (options or []) if isinstance(d, dict) for kv in d.items()]
    for k, v in items:
        out[str(k).strip().upper()] = str(v)
    return out


def _letter_in(text: str, letters: dict) -> str | None:
    stripped = re.sub(r"[\s\[\]\(\)\.\*\$]", "", text or "")
    stripped = stripped.replace("\\text{", "").replace("}", "").replace("{", "")
    return stripped if len(stripped) == 1 and stripped in letters else None


def _by_text(text: str, letters: dict) -> str | None:
    want = normalize(text)
    hits = [k for k, v in letters.items() if normalize(v) == want]
    return hits[0] if len(hits) == 1 else None


def extract_letter(text: str, letters: dict, mode: str) -> str | None:
    text = text or ""
    boxed = _BOXED.findall(text)
    if mode == "strict_single_letter_boxed":
        return _letter_in(boxed[-1], letters) if boxed else None
    if mode == "lenient_boxed":
        if not boxed:
            return None
        return _letter_in(boxed[-1], letters) or _by_text(boxed[0], letters)
    colon = _ANSWER_COLON.findall(text)
    if mode == "lenient_answer_colon":
        if not colon:
            return None
        tail = colon[-1].strip()
        return _letter_in(tail, letters) or _by_text(tail, letters)
    # free_text
    if boxed:
        got = _letter_in(boxed[-1], letters) or _by_text(boxed[-1], letters)
        if got:
            return got
    for tail in reversed(colon):
        got = _letter_in(tail.strip(), letters) or _letter_in(tail.strip()[:3], letters) or _by_text(tail, letters)
        if got:
            return got
    for pattern in (_ANSWER_IS, _PAREN, _LINE_LETTER):
        found = [m.upper() for m in pattern.findall(text) if m.upper() in letters]
        if found:
            return found[-1]
    return None


@register
class MultipleChoice(Verifier):
    """Multiple choice: the letter from \\boxed{} or free text against `expected_answer`."""

    name = "mcqa"
    kind = "cpu"
    required_fields = ("options", "expected_answer")
    options = {"grading_mode": (str, "free_text"), "answer_field": (str, "expected_answer")}

    def validate_options(self, options):
        out = super().validate_options(options)
        if out["grading_mode"] not in MODES:
            raise ValueError(f"verifier 'mcqa': grading_mode must be one of {', '.join(MODES)}, "
                             f"not {out['grading_mode']!r}")
        return out

    def verify(self, row, response_text, options):
        letters = parse_options(row.get("options") or (row.get("metadata") or {}).get("options"))
        if not letters:
            raise ValueError("row has no options")
        expected = str(row.get(options.get("answer_field") or "expected_answer", "")).strip().upper()
        mode = row.get("grading_mode") or options.get("grading_mode") or "free_text"
        if mode not in MODES:
            raise ValueError(f"grading_mode {mode!r} is not one of {', '.join(MODES)}")
        letter = extract_letter(response_text, letters, mode)
        return VerifyResult(reward=1.0 if letter is not None and letter == expected else 0.0,
                            fields={"extracted_answer": letter or "", "grading_mode": mode})
