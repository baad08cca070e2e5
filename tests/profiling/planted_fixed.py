"""The same verifier as planted_slow with both slowdowns fixed: a set, and lru_cache on the normalization."""
from __future__ import annotations

import re
from functools import lru_cache

from workers.verifiers import VerifyResult, Verifier, register

KNOWN_ANSWERS = frozenset(str(i) for i in range(200_000))


@lru_cache(maxsize=4096)
def normalize_answer(text: str) -> str:
    out = text
    for _ in range(40):
        out = re.sub(r"\s+", " ", out).strip().lower()
    m = re.findall(r"-?\d+", out)
    return m[-1] if m else ""


def is_known_answer(answer: str) -> bool:
    return answer in KNOWN_ANSWERS


@register
class PlantedFixedVerifier(Verifier):
    name = "planted_fixed"
    cpu_bound = True

    def verify(self, row, response_text, options):
        answer = normalize_answer(response_text[-64:])
        known = is_known_answer(str(int(answer) % 200_000 + 150_000 if answer else 0))
        expected = normalize_answer(str(row.get("expected_answer", "")))
        return VerifyResult(reward=1.0 if known and answer == expected else 0.0, fields={"known": known})
