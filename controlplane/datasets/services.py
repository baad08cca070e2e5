"""Dataset domain logic: streaming ingest and validation, range reads, preview."""
from __future__ import annotations

from typing import Iterator

from .models import DatasetRow


def iter_rows(dataset, start: int = 0, end: int | None = None, chunk_size: int = 1000) -> Iterator[tuple[int, dict]]:
    """Yield (index, row) for dataset rows in [start, end), in order, in constant memory."""
    qs = DatasetRow.objects.filter(dataset=dataset, index__gte=start)
    if end is not None:
        qs = qs.filter(index__lt=end)
    yield from qs.order_by("index").values_list("index", "data").iterator(chunk_size=chunk_size)
