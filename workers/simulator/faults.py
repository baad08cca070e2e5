"""Fault injection (by rate and per request) and the hosted-API rate limiter (RPM / TPM)."""
from __future__ import annotations

import math
import random
from collections import deque

from .config import FAULT_TYPES

FAULT_HEADER = "X-Sim-Fault"
RETRY_AFTER_HEADER = "X-Sim-Retry-After"


class FaultPicker:
    def __init__(self, seed: int):
        self.rng = random.Random(seed ^ 0xFA17)

    def pick(self, rates: dict[str, float], forced: str | None) -> str | None:
        """The fault for this request: the header wins; else one draw against the configured rates."""
        if forced:
            forced = forced.strip().lower()
            if forced in ("", "none"):
                return None
            if forced not in FAULT_TYPES:
                raise ValueError(f"unknown fault type {forced!r} in {FAULT_HEADER}; known types: {', '.join(FAULT_TYPES)}")
            return forced
        if not rates:
            return None
        u = self.rng.random()
        acc = 0.0
        for kind, rate in rates.items():
            acc += rate
            if u < acc:
                return kind
        return None


class RateLimiter:
    """Sliding 60 s windows of accepted requests (RPM) and their tokens (TPM)."""

    WINDOW_S = 60.0

    def __init__(self):
        self.reqs: deque[float] = deque()
        self.toks: deque[tuple[float, int]] = deque()
        self.tok_sum = 0

    def check(self, now: float, rpm: int, tpm: int, tokens: int) -> float | None:
        """None when admitted (and recorded); else seconds until a retry could pass."""
        horizon = now - self.WINDOW_S
        reqs, toks = self.reqs, self.toks
        while reqs and reqs[0] <= horizon:
            reqs.popleft()
        while toks and toks[0][0] <= horizon:
            self.tok_sum -= toks.popleft()[1]
        if rpm and len(reqs) >= rpm:
            return max(0.001, reqs[len(reqs) - rpm] + self.WINDOW_S - now)
        if tpm and self.tok_sum + tokens > tpm:
            if tokens > tpm:
                return self.WINDOW_S  # can never pass; say a full window
            need = self.tok_sum + tokens - tpm
            freed = 0
            for t, n in toks:
                freed += n
                if freed >= need:
                    return max(0.001, t + self.WINDOW_S - now)
            return self.WINDOW_S
        if rpm:
            reqs.append(now)
        if tpm:
            toks.append((now, tokens))
            self.tok_sum += tokens
        return None


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
