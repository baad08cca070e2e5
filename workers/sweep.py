"""Parallelism sweep: the profiling guide's quick diagnostic ("run at 5 and at 20"), automated into a curve.

The same sample of tasks is run at parallelism 1, 2, 4 ... up to `max_parallelism` with the engine's
`run_collection`; each level gets `max(min_tasks, waves * parallelism)` rollouts cycled from the sample, so
every level runs several full waves. Throughput is the level's successful rollouts from the end of its first
wave to its last completion (`level_rate`): start-up is left out, and with whole waves a closed loop's
synchronized waves are counted exactly.
The sweep stops early when throughput stops rising (less than `min_gain` over the best for `patience`
levels in a row) or when errors appear (error rate above `error_threshold`).

Result: the curve (parallelism, rollouts/s, p50/p99 latency, error rate), the knee (the smallest
parallelism reaching `knee_fraction` of the best throughput), a recommended setting, and what the curve
means in the profiling guide's words:
  time fell a lot         -> the model was the bottleneck (raise parallelism up to the knee)
  time similar            -> verification or network is the bottleneck (optimize infrastructure)
  errors or crashes       -> infrastructure overloaded (reduce parallelism)

    result = await run_sweep(spec, rows, max_parallelism=256)
    result.recommended, result.interpretation, result.to_dict()
"""
from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from workers.engine.aggregate import quantile
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, TaskItem

REQUEST_ERRORS = ("http_429", "http_5xx", "http_4xx", "timeout", "connection", "bad_response")

MIN_GAIN = 0.08  # a level must beat the best so far by this much to count as "still rising"
PATIENCE = 2  # levels in a row without that gain: stop
ERROR_THRESHOLD = 0.02  # request errors per attempt at a level: overloaded, stop
KNEE_FRACTION = 0.90  # the knee: smallest parallelism with >= 90% of the best throughput
SCALED_A_LOT = 2.0  # best / first-level throughput at or above: "time fell a lot"
TIME_SIMILAR = 1.5  # below: "time similar"


@dataclass
class SweepPoint:
    parallelism: int
    n: int
    completed: int
    failed: int
    elapsed_s: float
    rollouts_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    error_rate: float
    errors: dict = field(default_factory=dict)
    time_per_100_s: float | None = None  # the profiling guide's "time": seconds to collect 100 rollouts at this rate
    model_ms: float | None = None  # mean TTFT + generation
    verify_ms: float | None = None


@dataclass
class SweepResult:
    points: list[SweepPoint]
    knee: int | None
    recommended: int | None
    best_parallelism: int | None
    best_rollouts_per_s: float | None
    speedup: float | None  # best / first level throughput
    hint: str  # "model" | "verification" | "verification_or_network" | "overloaded" | "mixed" | "no_data"
    interpretation: str
    stopped_reason: str
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class _Recorder:
    """Sink for one level: keeps finish times, latencies and error counts."""

    def __init__(self, inner=None):
        self.inner = inner
        self.finish: list[float] = []
        self.wall: list[float] = []
        self.model: list[float] = []
        self.verify: list[float] = []
        self.ok = 0
        self.failed = 0
        self.errors: dict[str, int] = {}

    async def rollout(self, r) -> None:
        self.finish.append(time.monotonic())
        if r.ok:
            self.ok += 1
            if r.wall_ms is not None:
                self.wall.append(r.wall_ms)
            if r.ttft_ms is not None:
                self.model.append(r.ttft_ms + (r.generation_ms or 0.0))
            if r.verify_ms is not None:
                self.verify.append(r.verify_ms)
        else:
            self.failed += 1
        if self.inner is not None:
            await self.inner.rollout(r)

    async def progress(self, tick) -> None:
        for k, v in (tick.errors or {}).items():
            self.errors[k] = self.errors.get(k, 0) + int(v)
        if self.inner is not None:
            await self.inner.progress(tick)

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return quantile(sorted(values), q, "nearest")


def middle_rate(finish: list[float], t_start: float, lo: float = 0.1, hi: float = 0.9) -> float:
    """Completions per second between the lo- and hi-quantile finish times (ramp-up and tail left out).
    Right for open-loop / desynchronized completions; over-counts a closed loop's synchronized waves, so the
    sweep itself uses whole waves over the whole level instead."""
    n = len(finish)
    if n == 0:
        return 0.0
    s = sorted(finish)
    if n < 10:
        return n / max(1e-9, s[-1] - t_start)
    i, j = int(lo * n), int(hi * n) - 1
    span = s[j] - s[i]
    if span <= 0:
        return n / max(1e-9, s[-1] - t_start)
    return (j - i) / span


def level_rate(finish: list[float], t0: float, parallelism: int, ok: int) -> float:
    """Successful rollouts per second of a level, start-up left out: from the end of the first wave (the
    parallelism-th completion) to the last completion, over the completions in between. Each level runs
    whole waves (n = waves x parallelism), so a closed loop's synchronized waves are counted exactly, and
    neither the run's start-up (session, verifier pool, the server's first requests) nor the first
    request's latency is in it. With a single wave: start -> last completion."""
    if not ok or not finish:
        return 0.0
    s = sorted(finish)
    if len(s) > parallelism and ok > parallelism:
        span = s[-1] - s[parallelism - 1]
        if span > 0:
            return (min(ok, len(s)) - parallelism) / span
    return ok / max(1e-9, s[-1] - t0)


def default_levels(start: int = 1, max_parallelism: int = 512, factor: int = 2) -> list[int]:
    levels, p = [], max(1, start)
    while p <= max_parallelism:
        levels.append(p)
        p *= factor
    if levels and levels[-1] != max_parallelism and max_parallelism > levels[-1]:
        levels.append(max_parallelism)
    return levels


def _tasks_for(sample: list[dict], n: int) -> list[TaskItem]:
    """n TaskItems cycling over the sample rows (the same tasks at every level)."""
    out = []
    for k in range(n):
        i = k % len(sample)
        out.append(TaskItem(task_index=i, rollout_index=k // len(sample), row=sample[i]))
    return out


def analyze(points: list[SweepPoint], error_threshold: float = ERROR_THRESHOLD, knee_fraction: float = KNEE_FRACTION,
            stopped_reason: str = "") -> SweepResult:
    """Knee, recommendation and interpretation of a curve (pure)."""
    if not points:
        return SweepResult([], None, None, None, None, None, "no_data", "No sweep points.", stopped_reason or "no levels ran")
    clean = [p for p in points if p.error_rate <= error_threshold and p.completed > 0]
    errored = [p for p in points if p.error_rate > error_threshold]
    pool = clean or points
    best = max(pool, key=lambda p: p.rollouts_per_s)
    knee_pt = next(p for p in sorted(pool, key=lambda p: p.parallelism) if p.rollouts_per_s >= knee_fraction * best.rollouts_per_s)
    first = points[0]
    speedup = best.rollouts_per_s / first.rollouts_per_s if first.rollouts_per_s > 0 else None
    knee, rec = knee_pt.parallelism, knee_pt.parallelism
    parts = []
    if first.time_per_100_s and knee_pt.time_per_100_s:
        parts.append(f"Time for 100 rollouts: {first.time_per_100_s:.1f} s at parallelism {first.parallelism}, "
                     f"{knee_pt.time_per_100_s:.1f} s at {knee_pt.parallelism}.")
    if errored and errored[0].parallelism <= max(p.parallelism for p in pool) * 2:
        e = errored[0]
        top = ", ".join(f"{k} {v}" for k, v in sorted(e.errors.items(), key=lambda kv: -kv[1])[:3])
        hint = "overloaded"
        parts.append(f"Errors from parallelism {e.parallelism} ({100 * e.error_rate:.1f}% of requests: {top}): the "
                     f"infrastructure is overloaded or rate-limited there -> reduce parallelism; {rec} ran clean "
                     f"at {knee_pt.rollouts_per_s:.1f} rollouts/s.")
        if speedup is not None and speedup >= SCALED_A_LOT:
            parts.append(f"Below that, throughput scaled {speedup:.1f}x: the model was the bottleneck at low parallelism.")
    elif _queued_in_verification(points, knee_pt):
        hint = "verification"
        hi = max(points, key=lambda p: p.parallelism)
        parts.append(f"Throughput stops rising at parallelism {knee} ({knee_pt.rollouts_per_s:.1f} rollouts/s): beyond it "
                     f"requests wait for the verifier (verify time {first.verify_ms or 0:.0f} ms at {first.parallelism} -> "
                     f"{hi.verify_ms or 0:.0f} ms at {hi.parallelism}, model time {first.model_ms or 0:.0f} -> "
                     f"{hi.model_ms or 0:.0f} ms): verification is the bottleneck, not the model -> optimize "
                     f"verification (cache, fast mode, defer). Recommended: {rec}.")
    elif speedup is not None and speedup >= SCALED_A_LOT:
        hint = "model"
        parts.append(f"Time fell a lot ({speedup:.1f}x the throughput of parallelism {first.parallelism}): the model was the "
                     f"bottleneck. Throughput flattens at the knee, parallelism {knee} "
                     f"({knee_pt.rollouts_per_s:.1f} rollouts/s): beyond it requests only queue at the server. "
                     f"Recommended: {rec}.")
    elif speedup is not None and speedup < TIME_SIMILAR:
        hint = "verification_or_network"
        parts.append(f"Time similar across parallelism ({speedup:.2f}x at best): verification or the network / rate "
                     f"limit is the bottleneck, not the model -> optimize infrastructure. Recommended: {rec}.")
    else:
        hint = "mixed"
        parts.append(f"Throughput rose {speedup or 0:.1f}x then flattened at parallelism {knee}: the model scaled a little, "
                     f"then something else (verification, network, or the server) capped it. Recommended: {rec}.")
    return SweepResult(points=points, knee=knee, recommended=rec, best_parallelism=best.parallelism,
                       best_rollouts_per_s=round(best.rollouts_per_s, 3), speedup=round(speedup, 3) if speedup else None,
                       hint=hint, interpretation=" ".join(parts), stopped_reason=stopped_reason)


def _queued_in_verification(points: list[SweepPoint], knee_pt: SweepPoint) -> bool:
    """Past the knee, did the extra latency pile up in verification rather than at the model?"""
    hi = max(points, key=lambda p: p.parallelism)
    lo = min(points, key=lambda p: p.parallelism)
    if hi.parallelism <= knee_pt.parallelism or hi.verify_ms is None or lo.verify_ms is None:
        return False
    d_verify = hi.verify_ms - lo.verify_ms
    d_model = (hi.model_ms or 0.0) - (lo.model_ms or 0.0)
    return hi.verify_ms >= 2.0 * max(lo.verify_ms, 1.0) and d_verify > d_model


async def run_level(spec: CollectionSpec, sample: list[dict], parallelism: int, n: int, sink=None) -> SweepPoint:
    """Run n rollouts (cycled from `sample`) at one parallelism and measure it."""
    level_spec = dataclasses.replace(spec, parallelism=parallelism)
    rec = _Recorder(sink)
    t0 = time.monotonic()
    summary = await run_collection(level_spec, _tasks_for(sample, n), rec)
    elapsed = time.monotonic() - t0
    if summary.fatal_error and rec.ok == 0:
        raise RuntimeError(f"parallelism {parallelism}: {summary.fatal_error}")
    rate = level_rate(rec.finish, t0, parallelism, rec.ok)
    request_errors = sum(rec.errors.get(k, 0) for k in REQUEST_ERRORS)
    attempts = rec.ok + request_errors
    err_rate = request_errors / attempts if attempts else 0.0
    return SweepPoint(
        parallelism=parallelism, n=n, completed=rec.ok, failed=rec.failed, elapsed_s=round(elapsed, 3),
        rollouts_per_s=round(rate, 3), p50_ms=_round(_pct(rec.wall, 0.5)), p99_ms=_round(_pct(rec.wall, 0.99)),
        error_rate=round(err_rate, 4), errors=dict(rec.errors),
        time_per_100_s=round(100.0 / rate, 3) if rate > 0 else None,
        model_ms=_round(sum(rec.model) / len(rec.model)) if rec.model else None,
        verify_ms=_round(sum(rec.verify) / len(rec.verify)) if rec.verify else None,
    )


def _round(x):
    return None if x is None else round(x, 2)


async def run_sweep(
    spec: CollectionSpec,
    sample: Iterable[dict],
    *,
    levels: list[int] | None = None,
    max_parallelism: int = 512,
    start: int = 1,
    waves: int = 4,
    min_tasks: int = 16,
    max_tasks_per_level: int = 20000,
    min_gain: float = MIN_GAIN,
    patience: int = PATIENCE,
    error_threshold: float = ERROR_THRESHOLD,
    knee_fraction: float = KNEE_FRACTION,
    on_point: Callable[[SweepPoint], Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
    sink_factory: Callable[[int], Any] | None = None,
) -> SweepResult:
    """Run the sweep (see the module docstring). `sample` are dataset rows (dicts with
    responses_create_params). `on_point(point)` is called (and awaited if it returns an awaitable) after
    each level; `should_stop()` (may return an awaitable) is checked between levels."""
    rows = list(sample)
    if not rows:
        raise ValueError("the sweep needs at least one task row")
    levels = levels or default_levels(start, max_parallelism)
    points: list[SweepPoint] = []
    best = 0.0
    flat = 0
    reason = "reached the highest level"
    t0 = time.monotonic()
    for p in levels:
        if should_stop is not None:
            stop = should_stop()
            if inspect.isawaitable(stop):
                stop = await stop
            if stop:
                reason = "stopped by request"
                break
        n = min(max_tasks_per_level, max(min_tasks, waves * p))
        point = await run_level(spec, rows, p, n, sink_factory(p) if sink_factory else None)
        points.append(point)
        if on_point is not None:
            res = on_point(point)
            if inspect.isawaitable(res):
                await res
        if point.error_rate > error_threshold:
            reason = f"errors at parallelism {p} ({100 * point.error_rate:.1f}% of requests)"
            break
        if point.rollouts_per_s > best * (1.0 + min_gain):
            flat = 0
        else:
            flat += 1
            if flat >= patience:
                reason = f"throughput stopped rising ({patience} levels without a {int(min_gain * 100)}% gain)"
                best = max(best, point.rollouts_per_s)
                break
        best = max(best, point.rollouts_per_s)
    result = analyze(points, error_threshold=error_threshold, knee_fraction=knee_fraction, stopped_reason=reason)
    result.elapsed_s = round(time.monotonic() - t0, 3)
    return result
