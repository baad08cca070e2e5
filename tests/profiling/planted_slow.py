"""A verifier with two planted slowdowns of the profiling guide: a linear scan of a large list (`answer in
KNOWN_ANSWERS`, a list) and an expensive normalization recomputed on every call (no lru_cache)."""
from __future__ import annotations

import re

from workers.verifiers import VerifyResult, Verifier, register

KNOWN_ANSWERS = [str(i) for i in range(200_000)]  # a list: `in` scans it


def normalize_answer(text: str) -> str:
    out = text
    for _ in range(40):  # deliberately heavy, and the same inputs come back again and again
        out = re.sub(r"\s+", " ", out).strip().lower()
    m = re.findall(r"-?\d+", out)
    return m[-1] if m else ""


def is_known_answer(answer: str) -> bool:
    return answer in KNOWN_ANSWERS


@register
class PlantedSlowVerifier(Verifier):
    name = "planted_slow"
    cpu_bound = True

    def verify(self, row, response_text, options):
        answer = normalize_answer(response_text[-64:])
        known = is_known_answer(str(int(answer) % 200_000 + 150_000 if answer else 0))
        expected = normalize_answer(str(row.get("expected_answer", "")))
        return VerifyResult(reward=1.0 if known and answer == expected else 0.0, fields={"known": known})
