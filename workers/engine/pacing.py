"""Client-side pacing of requests: the RPM / TPM token bucket, retry backoff and Retry-After."""
from __future__ import annotations

import asyncio
import random
import time
from email.utils import parsedate_to_datetime


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date); None when absent or unparseable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None = None) -> float:
    """Delay before retry number `attempt + 1` (attempt counts from 0): Retry-After when the server sent
    one (capped at `cap`), else exponential `base * 2**attempt` capped at `cap`, with equal jitter."""
    if retry_after is not None:
        return min(cap, retry_after) * random.uniform(1.0, 1.1)
    delay = min(cap, base * (2 ** attempt))
    return delay / 2 + random.uniform(0, delay / 2)


class TokenBucket:
    """Client-side pacing: `per_minute` units per minute, bursts of one second's worth (at least one unit).

    `acquire(n)` takes n units, sleeping while the bucket is in debt; `adjust(n)` corrects an estimate
    afterwards (positive: more was used)."""

    def __init__(self, per_minute: float, burst: float | None = None):
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, burst if burst is not None else self.rate)
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    def _refill(self):
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def acquire(self, amount: float = 1.0):
        async with self.lock:
            self._refill()
            self.tokens -= amount
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)
                self._refill()

    def adjust(self, amount: float):
        self._refill()
        self.tokens -= amount
