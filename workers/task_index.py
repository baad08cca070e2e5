"""Task indices must be unique within a dataset: the engine keys rollouts on (task index, repeat), so
two rows with the same index would collect into the same slots and one would be lost.

A row's task index is its own `_ng_task_index` when it carries one, else its position among the good
rows (as the engine materializes it). The tracker remembers the line each index came from so the
report names both lines, in about 4 bytes per row: a dense array for indices near the row count
(the usual case: positions, or explicit indices 0..n-1), a dict only for far-apart explicit ones."""
from __future__ import annotations

from array import array

MAX_TASK_INDEX = 2**31 - 1  # the rollouts table stores it as a 32-bit integer


class TaskIndexTracker:
    def __init__(self):
        self._dense = array("I")  # line number per index; 0: not seen
        self._sparse: dict[int, int] = {}

    def _line_of(self, index: int) -> int | None:
        if index < len(self._dense):
            return self._dense[index] or None
        return self._sparse.get(index)

    def _remember(self, index: int, lineno: int) -> None:
        n = len(self._dense)
        if index >= n and index <= 2 * n + 1024:
            grow = max(index + 1, 2 * n) - n
            self._dense.extend(array("I", bytes(grow * self._dense.itemsize)))
            for k in [k for k in self._sparse if k < len(self._dense)]:
                self._dense[k] = self._sparse.pop(k)
        if index < len(self._dense):
            self._dense[index] = lineno
        else:
            self._sparse[index] = lineno

    def check(self, row, position: int, lineno: int) -> str | None:
        """None (and remember the index), or why this line's index cannot be used."""
        explicit = isinstance(row, dict) and "_ng_task_index" in row
        index = row["_ng_task_index"] if explicit else position
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_TASK_INDEX:
            return None  # validate_row reports it
        first = self._line_of(index)
        if first is not None:
            how = "_ng_task_index" if explicit else "its position"
            return f"task index {index} ({how}) repeats the task index of line {first}"
        self._remember(index, min(lineno, 2**32 - 1))
        return None
