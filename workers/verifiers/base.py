from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class VerifyResult:
    reward: float
    fields: dict[str, Any] = field(default_factory=dict)  # verifier's own output fields (NeMo Gym style)


class Verifier:
    """Subclass and register. `cpu_bound` verifiers run in the engine's process pool."""

    name = ""
    cpu_bound = False

    def verify(self, row: dict, response_text: str, options: dict) -> VerifyResult:
        raise NotImplementedError

    def fast_verify(self, row: dict, response_text: str, options: dict) -> VerifyResult:
        """A cheap heuristic for `fast` mode; verifiers without one use the exact check."""
        return self.verify(row, response_text, options)


VERIFIERS: dict[str, Verifier] = {}


def register(verifier_cls):
    VERIFIERS[verifier_cls.name] = verifier_cls()
    return verifier_cls


def get_verifier(name: str) -> Verifier:
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; known: {', '.join(sorted(VERIFIERS))}") from None


def verify_row(name: str, row: dict, response_text: str, options: dict | None = None, fast: bool = False) -> VerifyResult:
    verifier = get_verifier(name)
    options = options or {}
    return verifier.fast_verify(row, response_text, options) if fast else verifier.verify(row, response_text, options)


@register
class NoVerifier(Verifier):
    """Collect only: no reward (used by deferred verification's collection phase)."""

    name = "none"

    def verify(self, row, response_text, options):
        return VerifyResult(reward=0.0, fields={})
