"""Streaming aggregate metrics over NeMo Gym output rows, and timing percentiles.

`AggregateAccumulator` takes output rows one at a time and keeps one `array('d')` per numeric field
(8 bytes per value) plus a small record per open task for pass@k / majority@k (closed tasks fold into counters when rows
arrive in task order), so it can follow a job of any size without holding the rows. `result()` gives NeMo Gym-style keys:

    mean/reward, min/reward, max/reward, median/reward, std/reward   (every numeric field)
    mean/output_tokens ... (usage from `response.usage`: input_tokens, output_tokens, total_tokens,
                            cached_tokens, reasoning_tokens)
    pass@1, pass@k (unbiased estimator, k = 1, 2, 4, ... and the largest group size), majority@k
    num_rows, num_tasks

Numeric fields are the top-level int/float values of a row (booleans and the `_ng_*` indices excluded;
`responses_create_params` and other nested objects are not scanned, except `response.usage`).
"""
from __future__ import annotations

import math
import threading
from array import array
from collections import Counter
from fractions import Fraction
from typing import Any, Callable, Iterable

from .types import TIMING_FIELDS

_SKIP = {"_ng_task_index", "_ng_rollout_index"}
# a row's token counts read from response.usage where the row has no top-level key of that name
USAGE_KEYS = (
    ("input_tokens", ("input_tokens",)),
    ("output_tokens", ("output_tokens",)),
    ("total_tokens", ("total_tokens",)),
    ("cached_tokens", ("input_tokens_details", "cached_tokens")),
    ("reasoning_tokens", ("output_tokens_details", "reasoning_tokens")),
)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and not math.isinf(v)


def quantile(sorted_values, q: float, method: str = "linear") -> float:
    """Quantile q (0..1) of an already sorted sequence; nan when it is empty.

    method "linear": interpolated between the two nearest ranks (numpy's default), as a float.
    method "nearest": the element at rank int(q * n) (the last one at most), no interpolation -- the
    cheap p50/p99 the telemetry and sweep report."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    if method == "nearest":
        return sorted_values[min(n - 1, int(n * q))]
    if method != "linear":
        raise ValueError(f"unknown quantile method: {method!r}")
    pos = (n - 1) * q
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


def describe(values) -> dict[str, float]:
    """mean, min, max, median, std (population) of a non-empty sequence of floats."""
    n = len(values)
    s = sorted(values)
    mean = math.fsum(s) / n
    var = math.fsum((x - mean) ** 2 for x in s) / n
    return {"mean": mean, "min": s[0], "max": s[-1], "median": quantile(s, 0.5), "std": math.sqrt(var)}


_SCALE = 1074  # every finite float is an integer multiple of 2**-1074


class RunningStats:
    """count, exact sum, exact sum of squares, min and max of floats, in constant memory: the figures of
    `describe` without keeping the values. The mean is the same float as `describe`'s (the correctly
    rounded sum over n, like math.fsum); the std is the correctly rounded population std of the exact
    values, which can differ from `describe`'s (a sum of rounded squared deviations) in the last bits
    (relative error below 1e-15). The median is not here: it needs the values (see `quantile_ranks`)."""

    __slots__ = ("count", "_sum", "_sumsq", "min", "max")

    def __init__(self):
        self.count = 0
        self._sum = 0  # exact sum, in units of 2**-1074
        self._sumsq = 0  # exact sum of squares, in units of 2**-2148
        self.min = math.inf
        self.max = -math.inf

    def add(self, x: float) -> None:
        num, den = x.as_integer_ratio()
        scaled = num << (_SCALE - den.bit_length() + 1)
        self.count += 1
        self._sum += scaled
        self._sumsq += scaled * scaled
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x

    def mean(self) -> float | None:
        if not self.count:
            return None
        return float(Fraction(self._sum, 1 << _SCALE)) / self.count

    def describe(self, median: float) -> dict[str, float]:
        mean = self.mean()
        m = Fraction(mean)
        s = Fraction(self._sum, 1 << _SCALE)
        q = Fraction(self._sumsq, 1 << (2 * _SCALE))
        ssd = q - 2 * m * s + self.count * m * m  # exact sum of (x - mean)**2
        var = float(ssd) / self.count
        return {"mean": mean, "min": self.min, "max": self.max, "median": median, "std": math.sqrt(var)}


def quantile_ranks(n: int, q: float, method: str = "linear") -> tuple[int, int, float]:
    """(lo, hi, frac): `quantile` of n sorted values is v[lo] + (v[hi] - v[lo]) * frac (nearest: v[lo]),
    so a caller that can fetch the values at given ranks (ORDER BY ... OFFSET lo) needs no more."""
    if method == "nearest":
        i = min(n - 1, int(n * q))
        return i, i, 0.0
    pos = (n - 1) * q
    lo = int(math.floor(pos))
    return lo, min(lo + 1, n - 1), pos - lo


def quantile_from_ranks(lo_value: float, hi_value: float, frac: float) -> float:
    """`quantile`'s interpolation, given the values at the ranks of `quantile_ranks`."""
    return float(lo_value + (hi_value - lo_value) * frac)


def timing_percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """{p50, p90, p99} of the values (None entries ignored); all None when there are none."""
    s = sorted(v for v in values if v is not None)
    if not s:
        return {"p50": None, "p90": None, "p99": None}
    return {"p50": quantile(s, 0.5), "p90": quantile(s, 0.9), "p99": quantile(s, 0.99)}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError("k must be <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class _Group:
    __slots__ = ("n", "c", "answers")

    def __init__(self):
        self.n = 0
        self.c = 0
        self.answers: dict[str, list] | None = None  # extracted answer -> [count, correct?, first seen order]


class AggregateAccumulator:
    """Aggregate metrics over output rows, added one at a time (see the module docstring)."""

    def __init__(self, reward_threshold: float = 1.0, answer_field: str = "extracted_answer",
                 ordered_by_task: bool = False, keep_values: bool = True):
        """ordered_by_task: rows arrive grouped by `_ng_task_index` (e.g. read in (task, repeat)
        order from the database). Each task is then folded into a few counters as soon as the next
        one starts, so memory for pass@k / majority@k stays constant however many tasks a job has.
        keep_values=False: keep a `RunningStats` per field instead of every value (constant memory);
        `result(medians=...)` then needs the medians from whoever holds the rows (e.g. the database)."""
        self.keep_values = keep_values
        self.stats: dict[str, RunningStats] = {}
        self.reward_threshold = reward_threshold
        self.answer_field = answer_field
        self.ordered_by_task = ordered_by_task
        self.fields: dict[str, array] = {}
        self.groups: dict[Any, _Group] = {}  # tasks still open
        self.folded: Counter = Counter()  # (n, c) -> number of closed tasks with n rows, c correct
        self.majority = [0, 0]  # closed tasks with answers: [majority answer right, total]
        self.num_rows = 0

    def _fold(self, task) -> None:
        g = self.groups.pop(task)
        self.folded[(g.n, g.c)] += 1
        if g.answers:
            self.majority[0] += bool(_majority_correct(g))
            self.majority[1] += 1

    def _push(self, key: str, value: float):
        if not self.keep_values:
            st = self.stats.get(key)
            if st is None:
                st = self.stats[key] = RunningStats()
            st.add(float(value))
            return
        arr = self.fields.get(key)
        if arr is None:
            arr = self.fields[key] = array("d")
        arr.append(float(value))

    def add(self, row: dict, order: int | None = None) -> None:
        """order: the row's repeat index, for rows that arrive out of (task, repeat) order; majority@k's
        tie goes to the answer of the lowest repeat, as it does to the first seen of rows read in order."""
        self.num_rows += 1
        for key, value in row.items():
            if key in _SKIP:
                continue
            if _is_number(value):
                self._push(key, value)
        response = row.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict):
            for name, path in USAGE_KEYS:
                v: Any = usage
                for p in path:
                    v = v.get(p) if isinstance(v, dict) else None
                if _is_number(v) and name not in row:
                    self._push(name, v)

        reward = row.get("reward")
        if _is_number(reward):
            task = row.get("_ng_task_index")
            group = self.groups.get(task)
            if group is None:
                if self.ordered_by_task:
                    for open_task in list(self.groups):
                        self._fold(open_task)
                group = self.groups[task] = _Group()
            group.n += 1
            correct = reward >= self.reward_threshold
            group.c += int(correct)
            answer = row.get(self.answer_field)
            if answer is not None:
                if group.answers is None:
                    group.answers = {}
                slot = group.answers.get(str(answer))
                if slot is None:
                    group.answers[str(answer)] = [1, correct, len(group.answers) if order is None else order]
                else:
                    slot[0] += 1
                    slot[1] = slot[1] or correct
                    if order is not None and order < slot[2]:
                        slot[2] = order

    def add_many(self, rows: Iterable[dict]) -> "AggregateAccumulator":
        for row in rows:
            self.add(row)
        return self

    def result(self, medians: Callable[[str, int], float] | None = None) -> dict[str, Any]:
        """medians(key, count): the median of a field's values, needed when keep_values is False."""
        out: dict[str, Any] = {"num_rows": self.num_rows}
        for key in sorted(self.fields):
            for stat, value in describe(self.fields[key]).items():
                out[f"{stat}/{key}"] = value
        for key in sorted(self.stats):
            st = self.stats[key]
            if medians is None:
                raise ValueError("keep_values=False needs the medians")
            for stat, value in st.describe(medians(key, st.count)).items():
                out[f"{stat}/{key}"] = value
        for task in list(self.groups):  # close what is open (result() is called at the end)
            self._fold(task)
        if self.folded:
            out["num_tasks"] = sum(self.folded.values())
            kmax = max(n for n, _ in self.folded)
            ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k <= kmax} | {kmax})
            for k in ks:
                eligible = [(n, c, count) for (n, c), count in self.folded.items() if n >= k]
                if eligible:
                    total = sum(count for _, _, count in eligible)
                    out[f"pass@{k}"] = math.fsum(pass_at_k(n, c, k) * count for n, c, count in eligible) / total
            if kmax > 1 and self.majority[1]:
                out[f"majority@{kmax}"] = self.majority[0] / self.majority[1]
        return out


def _majority_correct(group: _Group) -> bool:
    # most common answer; ties go to the answer seen first
    best = max(group.answers.values(), key=lambda s: (s[0], -s[2]))
    return bool(best[1])


class TimingAccumulator:
    """Per-rollout timings (queue/ttft/generation/verify/wall, in ms) -> percentiles and means."""

    NAMES = TIMING_FIELDS

    def __init__(self, names: Iterable[str] = NAMES, keep_values: bool = True):
        """keep_values=False: a `RunningStats` per name, not the values; `result(percentiles=...)` then
        needs the percentiles from whoever holds the rows."""
        self.keep_values = keep_values
        self.values: dict[str, array] = {n: array("d") for n in names} if keep_values else {}
        self.stats = {} if keep_values else {n: RunningStats() for n in names}

    def add(self, result: Any = None, **timings: float | None) -> None:
        """Add the timings of a RolloutResult (or any object with those attributes), or keyword values."""
        for name, arr in (self.values or self.stats).items():
            v = timings.get(name) if name in timings else getattr(result, name, None)
            if v is not None:
                (arr.append if self.keep_values else arr.add)(float(v))

    def result(self, percentiles: Callable[[str, int], dict] | None = None) -> dict[str, dict[str, float | None]]:
        """percentiles(name, count) -> {p50, p90, p99}: needed when keep_values is False."""
        out = {}
        for name, st in self.stats.items():
            if percentiles is None:
                raise ValueError("keep_values=False needs the percentiles")
            stats = dict(percentiles(name, st.count)) if st.count else {"p50": None, "p90": None, "p99": None}
            stats["mean"] = st.mean()
            stats["max"] = st.max if st.count else None
            stats["count"] = st.count
            out[name] = stats
        for name, arr in self.values.items():
            stats: dict[str, float | None] = timing_percentiles(arr)
            stats["mean"] = (math.fsum(arr) / len(arr)) if arr else None
            stats["max"] = max(arr) if arr else None
            stats["count"] = len(arr)
            out[name] = stats
        return out


class _StatsWithValues(AggregateAccumulator):
    """keep_values=False's RunningStats per field, and the values beside them for the medians."""

    def __init__(self):
        super().__init__(keep_values=False)
        self.values: dict[str, array] = {}

    def _push(self, key: str, value: float):
        super()._push(key, value)
        arr = self.values.get(key)
        if arr is None:
            arr = self.values[key] = array("d")
        arr.append(float(value))


class StoredRowSummaries:
    """The end-of-job summaries, fed with each row as it is stored, for a process that stores every row of
    its job itself (the drop-in command): at the end it gives what reading the table back gives (the same
    RunningStats, the medians and percentiles at the same ranks, majority@k's ties to the lowest repeat)
    without that second read. Bounded: past `max_rows` rows it lets go of what it holds (8 bytes a value,
    a small record a task) and `result` gives None, as it does when the table holds rows it was not fed.
    Thread-safe: the command's DB thread and its child processes' reader both feed it."""

    def __init__(self, max_rows: int = 100_000):
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self.rows = 0
        self.agg: _StatsWithValues | None = _StatsWithValues()
        self.timing = TimingAccumulator(keep_values=False)
        self.timing_values: dict[str, array] = {n: array("d") for n in TIMING_FIELDS}

    def add(self, ok: bool, data: Any, rollout_index: int, timings: dict[str, float | None]) -> None:
        """A stored row: ok (its status), its output row, its repeat index and its TIMING_FIELDS."""
        with self._lock:
            self._add(ok, data, rollout_index, timings)

    def _add(self, ok, data, rollout_index, timings) -> None:
        self.rows += 1
        if self.agg is None:
            return
        if self.rows > self.max_rows:
            self.agg, self.timing_values = None, {}
            return
        self.timing.add(**timings)
        for name, value in timings.items():
            if value is not None and name in self.timing_values:
                self.timing_values[name].append(float(value))
        if ok:
            self.agg.add(data, order=rollout_index)

    def result(self, stored_rows: int) -> tuple[dict, dict] | None:
        """(aggregate_metrics, timing_summary), or None when the job's table holds `stored_rows` rows and
        they are not exactly the rows fed (a resumed job, another process's rows) or there were too many."""
        with self._lock:
            agg = self.agg
            if agg is None or stored_rows != self.rows:
                return None
            return (agg.result(medians=lambda key, n: quantile(sorted(agg.values[key]), 0.5)),
                    self.timing.result(percentiles=lambda name, n: timing_percentiles(self.timing_values[name])))
