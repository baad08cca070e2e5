"""Task indices as `ng_collect_rollouts` (nemo-gym 0.4.0) assigns them, so the product's rows carry the same
(`_ng_task_index`, `_ng_rollout_index`) pairs as NeMo Gym's on the same file.

NeMo Gym (`RolloutCollectionHelper._preprocess_rows_from_config`):
* a row's own `_ng_task_index` is kept;
* a row without one gets `row_to_task_idx.setdefault(line, len(row_to_task_idx))`: identical input lines
  share one index, and distinct lines are numbered 0, 1, 2... in order of first appearance (rows that carry
  their own index are not counted);
* rollout indices are counted per task index across the whole file: the first row with task index t gets
  rollouts 0..R-1, the next row with the same t (an identical line, or an explicit repeat) R..2R-1, and so on.

So each stored row keeps (task index, occurrence); its rollouts are occurrence*R .. occurrence*R + R-1, and
(task, rollout) stays unique per job without refusing any line NeMo Gym accepts.

`TaskIndexer` numbers rows in memory (one 16-byte digest per distinct line, ~4 bytes per task index for the
counts): the standalone engine CLI, and dataset ingest up to a bound of rows. Ingest stores each line's digest,
and a file longer than the bound is numbered in the database afterwards
(controlplane.datasets.services.number_tasks), in constant memory.
"""
from __future__ import annotations

import bisect
import hashlib
from array import array

MAX_TASK_INDEX = 2**31 - 1  # the rollouts table stores it as a 32-bit integer


class _Counts:
    """task index -> how many rows had it so far."""

    def __init__(self):
        self._dense = array("I")
        self._sparse: dict[int, int] = {}

    def bump(self, index: int) -> int:
        """The count before this row (its occurrence), then count it."""
        n = len(self._dense)
        if n <= index <= 2 * n + 1024:
            grow = max(index + 1, 2 * n) - n
            self._dense.extend(array("I", bytes(grow * self._dense.itemsize)))
            for k in [k for k in self._sparse if k < len(self._dense)]:
                self._dense[k] = self._sparse.pop(k)
        if index < len(self._dense):
            seen = self._dense[index]
            self._dense[index] = seen + 1
        else:
            seen = self._sparse.get(index, 0)
            self._sparse[index] = seen + 1
        return seen


class TaskIndexer:
    def __init__(self):
        self._line_index: dict[bytes, int] = {}
        self._counts = _Counts()

    def assign(self, row: dict, line: str | bytes) -> tuple[int, int]:
        """(task index, occurrence) of the next row; `line` is its JSON text as read from the file."""
        if "_ng_task_index" in row:
            return self.assign_own(row["_ng_task_index"])
        return self.assign_line(line_digest(line))

    def assign_own(self, index: int) -> tuple[int, int]:
        """The next row carries its own task index."""
        return index, self._counts.bump(index)

    def assign_line(self, digest: bytes) -> tuple[int, int]:
        """The next row has none: numbered by its line (`digest`: line_digest of its text)."""
        index = self._line_index.setdefault(digest, len(self._line_index))
        return index, self._counts.bump(index)


def line_digest(line: str | bytes) -> bytes:
    """The key identical lines share (16 bytes; the product stores it per row and lets the database group)."""
    return hashlib.blake2b(line.encode() if isinstance(line, str) else line, digest_size=16).digest()


def rollout_indices(occurrence: int, num_repeats: int) -> range:
    """The rollout indices of a row: NeMo Gym counts them per task index across the file."""
    return range(occurrence * num_repeats, (occurrence + 1) * num_repeats)


class IndexRuns:
    """A set of task indices kept as sorted runs of consecutive values (lo..hi): a chunk's indices, ascending
    and mostly contiguous, take a few bytes in all instead of a set's ~60 bytes per index (~15 MB for a chunk of
    250,000 rows, growing the worker with the job). Indices may come in any order."""

    __slots__ = ("_lo", "_hi")

    def __init__(self, values=()):
        self._lo, self._hi = array("q"), array("q")
        for v in values:
            self.add(v)

    def add(self, i: int) -> None:
        lo, hi = self._lo, self._hi
        if hi and i == hi[-1] + 1:  # the usual case: the next index
            hi[-1] = i
            return
        k = bisect.bisect_right(lo, i) - 1  # the run starting at or before i
        if k >= 0 and i <= hi[k]:
            return
        left = k >= 0 and hi[k] + 1 == i
        right = k + 1 < len(lo) and lo[k + 1] - 1 == i
        if left and right:
            hi[k] = hi[k + 1]
            del lo[k + 1], hi[k + 1]
        elif left:
            hi[k] = i
        elif right:
            lo[k + 1] = i
        else:
            lo.insert(k + 1, i)
            hi.insert(k + 1, i)

    def ranges(self) -> list[tuple[int, int]]:
        """The runs, ascending: (first, last), both included."""
        return list(zip(self._lo, self._hi))

    def __contains__(self, i) -> bool:
        k = bisect.bisect_right(self._lo, i) - 1
        return k >= 0 and i <= self._hi[k]

    def __iter__(self):
        for lo, hi in zip(self._lo, self._hi):
            yield from range(lo, hi + 1)

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in zip(self._lo, self._hi))

    def __bool__(self) -> bool:
        return bool(self._lo)
