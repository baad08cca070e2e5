"""Keyset pagination over a job's rollouts on (job, id): `WHERE job_id = J AND id > cursor ORDER BY id
LIMIT n` walks the (job, id) index, so page 1,000 of a million rows costs what page 1 costs — no OFFSET,
and no COUNT(*) over the whole job."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KeysetPage:
    rows: list
    next_after: int | None  # pass as ?after= for the next page
    prev_before: int | None  # pass as ?before= for the previous page
    size: int


def keyset_page(qs, *, after: int | None = None, before: int | None = None, size: int = 50) -> KeysetPage:
    """One page of `qs` (already filtered to one job) ordered by id ascending.
    `after`: rows with id > after (forward). `before`: rows with id < before (backward), returned in
    ascending order. Neither: the first page."""
    size = max(1, min(int(size), 500))
    if before is not None:
        rows = list(qs.filter(id__lt=before).order_by("-id")[: size + 1])
        more_before = len(rows) > size
        rows = list(reversed(rows[:size]))
        return KeysetPage(
            rows=rows,
            next_after=rows[-1].id if rows else None,
            prev_before=rows[0].id if (rows and more_before) else None,
            size=size,
        )
    base = qs.filter(id__gt=after) if after is not None else qs
    rows = list(base.order_by("id")[: size + 1])
    more_after = len(rows) > size
    rows = rows[:size]
    return KeysetPage(
        rows=rows,
        next_after=rows[-1].id if (rows and more_after) else None,
        prev_before=rows[0].id if (rows and after is not None) else None,
        size=size,
    )
