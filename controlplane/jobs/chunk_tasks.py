"""A chunk's tasks for the engine: its dataset rows in NeMo Gym order, a page at a time on the DB thread, less the
(task, repeat) pairs the job has stored already; and the completeness check after a run."""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import connection

from controlplane.datasets.services import iter_task_rows, iter_task_rows_at
from workers.engine.materialize import materialize_tasks, row_repeats
from workers.task_index import IndexRuns

from .models import Rollout
from .openended import pass_rows

if TYPE_CHECKING:
    from .sink import DbThread

# Rows read per page: a page is JSON decoded in one burst on the DB thread (~12 objects a row) and lives, with the
# one prefetched, while the engine takes it. At 1,000 rows the worker's pymalloc arenas grew with the job (one
# 100k-rollout chunk: 93 -> 96 MB, never given back); at 200 they stayed flat (92). bench_scale workers.
PAGE_ROWS = 200


def stored_pairs_in_ranges(job_id, tasks: list[int], los: list[int], his: list[int], count: bool = False):
    """PostgreSQL: the job's stored (task_index, rollout_index) pairs with task_index tasks[i] and rollout_index in
    [los[i], his[i]) (their number with `count`), one probe of the (job, task_index, rollout_index) index per task:
    a LATERAL subquery that OFFSET 0 keeps from being flattened into a join the planner may reorder. Asked as an
    IN list of tasks with the repeat range, PostgreSQL scanned every stored row of the job in that range whenever
    its statistics judged the range rare (repeat indices past a young table's histogram: a file's repeated lines):
    50-120 ms a query at 400k stored rows of a 1M-row job, a query per occurrence at each chunk's end, against
    ~1 ms as probes."""
    if not tasks:
        return 0 if count else []
    table = connection.ops.quote_name(Rollout._meta.db_table)
    sql = (f"SELECT {'count(*)' if count else 'x.task_index, x.rollout_index'} "
           f"FROM unnest(%s::integer[], %s::integer[], %s::integer[]) AS g(task, lo, hi) CROSS JOIN LATERAL ("
           f"SELECT r.task_index, r.rollout_index FROM {table} AS r WHERE r.job_id = %s AND r.task_index = g.task "
           f"AND r.rollout_index >= g.lo AND r.rollout_index < g.hi OFFSET 0) AS x")
    with connection.cursor() as cur:
        cur.execute(sql, [list(tasks), list(los), list(his), job_id])
        return cur.fetchone()[0] if count else cur.fetchall()


class ChunkTasks:
    """The chunk's TaskItems in NeMo Gym order, read a page at a time on the DB thread (one page
    prefetched), skipping the (task_index, rollout_index) pairs already stored for the job.

    Rows carry NeMo Gym's numbering (task index, occurrence; workers/task_index.py): identical lines share a
    task index, possibly across chunks, so a chunk owns the pairs (t, occurrence*R + r), not whole tasks."""

    def __init__(self, *, job, chunk, db: DbThread, page_rows=PAGE_ROWS):
        self.job_id = job.pk
        self.dataset = job.dataset
        self.num_repeats = job.num_repeats
        self.repeats = row_repeats(job.num_repeats, job.collection_options)  # R, or R per row's agent
        self.expected = 0
        end = chunk.end_row
        if job.limit:
            end = min(end, job.limit)
        self.start, self.end = chunk.start_row, end
        # open-ended jobs: the pass's repeat indices and row order (controlplane.jobs.openended)
        from .openended import pass_offset

        self.job, self.pass_index = job, chunk.pass_index
        self.offset = pass_offset(job, chunk.pass_index)
        self.db = db
        self.page_rows = page_rows
        self.emitted = 0
        self.skipped = 0
        self.rows_seen = 0
        # (occurrence, R) -> the chunk's task indices with it (to check completeness after the run), as runs of
        # consecutive indices: constant memory for the usual contiguous chunk
        self.tasks_by_occurrence: dict[tuple[int, int], IndexRuns] = {}

    @property
    def task_ids(self) -> set[int]:
        return set().union(*self.tasks_by_occurrence.values()) if self.tasks_by_occurrence else set()

    def _page(self, start):
        stop = min(start + self.page_rows, self.end)
        shuffled = pass_rows(self.job, self.pass_index, start, stop)
        rows = list(iter_task_rows(self.dataset, start, stop) if shuffled is None
                    else iter_task_rows_at(self.dataset, shuffled))
        task_ids = set()
        for task_index, _occurrence, _row in rows:
            try:
                task_ids.add(int(task_index))
            except (TypeError, ValueError):
                pass  # materialize_tasks raises the clear error
        existing = set()
        if task_ids and connection.vendor == "postgresql":
            groups: tuple[list[int], list[int], list[int]] = ([], [], [])
            for task_index, occurrence, row in rows:  # exactly the page's pairs: its rows' repeats of their occurrence
                try:
                    task = int(task_index)
                except (TypeError, ValueError):
                    continue
                r = self.repeats(row) if callable(self.repeats) else self.repeats
                lo = self.offset + occurrence * r
                groups[0].append(task), groups[1].append(lo), groups[2].append(lo + r)
            existing = set(stored_pairs_in_ranges(self.job_id, *groups))
        elif task_ids:
            pairs = Rollout.objects.filter(job_id=self.job_id).with_task_indices(task_ids)
            if self.offset or self.job.open_ended:  # this pass's repeats only
                pairs = pairs.filter(rollout_index__gte=self.offset,
                                     rollout_index__lt=self.offset + self.job.open_ended["stride"])
            existing = set(pairs.values_list("task_index", "rollout_index"))
        return rows, existing, stop

    def stored_count(self) -> int:
        """How many of the chunk's (task, repeat) pairs are in the table now."""
        if connection.vendor == "postgresql":
            groups: tuple[list[int], list[int], list[int]] = ([], [], [])
            for (occurrence, r), ids in self.tasks_by_occurrence.items():
                lo = self.offset + occurrence * r
                for task in ids:
                    groups[0].append(task), groups[1].append(lo), groups[2].append(lo + r)
            return stored_pairs_in_ranges(self.job_id, *groups, count=True)
        qs = Rollout.objects.filter(job_id=self.job_id)
        total = 0
        for (occurrence, r), ids in self.tasks_by_occurrence.items():
            pairs = qs.filter(rollout_index__gte=self.offset + occurrence * r,
                              rollout_index__lt=self.offset + (occurrence + 1) * r)
            runs = ids.ranges()
            if len(runs) == 1:  # the usual case: a contiguous range of task indices
                total += pairs.filter(task_index__gte=runs[0][0], task_index__lte=runs[0][1]).count()
            else:
                total += pairs.filter(task_index__in=list(ids)).count()
        return total

    @property
    def expected_count(self) -> int:
        return self.expected

    def __iter__(self):
        if self.start >= self.end:
            return
        future = self.db.submit(self._page, self.start)
        while future is not None:
            rows, existing, stop = future.result()
            future = self.db.submit(self._page, stop) if stop < self.end else None
            for task_index, occurrence, row in rows:
                self.rows_seen += 1
                r = self.repeats(row) if callable(self.repeats) else self.repeats
                self.expected += r
                self.tasks_by_occurrence.setdefault((occurrence, r), IndexRuns()).add(int(task_index))
            for item in materialize_tasks(rows, self.repeats):
                if self.offset:
                    item.rollout_index += self.offset
                if (item.task_index, item.rollout_index) in existing:
                    self.skipped += 1
                    continue
                self.emitted += 1
                yield item
