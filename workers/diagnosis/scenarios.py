"""Helpers to put a run into a bottleneck on purpose (scenario tests, benchmarks, demos).

- `BurnVerifier` ("burn"): a CPU-bound verifier that burns `burn_ms` of CPU per row (busy loop), then
  scores exact match on the last number; it runs in the engine's verification process pool.
- `InlineBurnVerifier` ("burn_inline"): the same, not marked cpu_bound, so it runs on the event loop.
- `SleepVerifier` ("sleep_verify"): a pool verifier that waits `sleep_ms` (a slow external call).
- `use_scenario_verify_pool(processes)`: the engine's pool imports `workers.verifiers` in its processes,
  not this module; this restarts the engine's shared pool (or the given one) with processes that import
  this module first, so "burn" / "sleep_verify" resolve there.
- `LoopBlockingSink(inner, block_ms)`: a sink that blocks the event loop for `block_ms` per rollout (a
  busy wait, as heavy per-row serialization would) - the honest way to make a run control-plane-bound.
- `rows_math(n)`: arithmetic tasks the simulator answers.
"""
from __future__ import annotations

import importlib
import time

from workers.verifiers.base import Verifier, VerifyResult, register


def _burn(ms: float) -> None:
    end = time.perf_counter() + ms / 1000.0
    x = 0
    while time.perf_counter() < end:
        x += 1


@register
class BurnVerifier(Verifier):
    name = "burn"
    cpu_bound = True

    def verify(self, row, response_text, options):
        _burn(float(options.get("burn_ms", 10.0)))
        import re

        nums = re.findall(r"-?\d+", response_text or "")
        expected = str(row.get("expected_answer", ""))
        return VerifyResult(reward=1.0 if nums and nums[-1] == expected else 0.0, fields={"burned_ms": options.get("burn_ms", 10.0)})

    def fast_verify(self, row, response_text, options):
        return VerifyResult(reward=0.0, fields={})


@register
class InlineBurnVerifier(BurnVerifier):
    """The same CPU burn, but not marked cpu_bound: the engine runs it on the event loop (a common mistake)."""

    name = "burn_inline"
    cpu_bound = False


@register
class SleepVerifier(Verifier):
    name = "sleep_verify"
    cpu_bound = True

    def verify(self, row, response_text, options):
        time.sleep(float(options.get("sleep_ms", 10.0)) / 1000.0)
        return VerifyResult(reward=1.0, fields={})


def _init_worker(module: str) -> None:
    importlib.import_module(module)


def use_scenario_verify_pool(processes: int, pool=None) -> None:
    """Make a verification pool (default: the engine's shared one) of size `processes` know this module's
    verifiers, with its processes started now so the first rollouts do not pay for it."""
    from workers.engine.verify_pool import SHARED_VERIFY_POOL

    (pool or SHARED_VERIFY_POOL).configure(_init_worker, (__name__,), processes)


class LoopBlockingSink:
    """Wraps a sink; blocks the event loop `block_ms` per rollout (busy wait)."""

    def __init__(self, inner=None, block_ms: float = 5.0):
        self.inner = inner
        self.block_ms = block_ms

    async def rollout(self, result):
        _burn(self.block_ms)
        if self.inner is not None:
            await self.inner.rollout(result)

    async def progress(self, tick):
        if self.inner is not None:
            await self.inner.progress(tick)

    async def close(self):
        if self.inner is not None:
            await self.inner.close()


def rows_math(n: int, seed: int = 0) -> list[dict]:
    import random

    rnd = random.Random(seed)
    rows = []
    for _i in range(n):
        a, b = rnd.randint(1, 99), rnd.randint(1, 99)
        rows.append({
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + {b}?"}]},
            "expected_answer": str(a + b),
        })
    return rows


def task_items(rows: list[dict], repeats: int = 1):
    from workers.engine.materialize import materialize

    return list(materialize(enumerate(rows), repeats))
