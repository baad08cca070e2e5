"""A chunk reads which of a page's (task, repeat) pairs are already stored with one query per page. A file with
repeated lines gives a page the task indices of earlier lines too (NeMo Gym numbering): the query must still
read only the page's own index entries, not every stored row between the smallest and the largest index (the
cost grew with the job: 58 ms a page at 65k stored rows, the worker's rate falling through a 100k job)."""
from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.jobs.models import CollectionJob, Rollout
from tests.factories import make_dataset, make_endpoint, make_user

STORED = 20_000


def _rows_read(sql: str, params) -> int:
    """Rows the plan's scans produced or threw away (EXPLAIN ANALYZE): what the query really read."""
    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cur.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    total, stack = 0, [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        if "Scan" in node["Node Type"] and "Bitmap Index" not in node["Node Type"]:
            total += node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0) \
                + node.get("Rows Removed by Index Recheck", 0)
        stack.extend(node.get("Plans", []))
    return total


@pytest.mark.django_db
def test_a_page_with_earlier_tasks_reads_its_own_pairs_only():
    if connection.vendor != "postgresql":
        pytest.skip("the plan is PostgreSQL's")
    owner = make_user("pages")
    job = CollectionJob.objects.create(owner=owner, dataset=make_dataset(owner, n=3), endpoint=make_endpoint(owner),
                                       state="running", num_repeats=1, total_rollouts=30_000)
    Rollout.objects.bulk_create([Rollout(job=job, task_index=t, rollout_index=0, status="ok", data={})
                                 for t in range(STORED)], batch_size=2000)  # no ANALYZE: a fresh job's table
    # the page: 200 new tasks, 150 of the last stored ones, and repeats of three early lines
    page = {5, 17, 1234} | set(range(STORED - 150, STORED)) | set(range(25_000, 25_200))
    with CaptureQueriesContext(connection) as ctx:
        existing = set(Rollout.objects.filter(job_id=job.pk).with_task_indices(page)
                       .values_list("task_index", "rollout_index"))
    assert existing == {(t, 0) for t in page if t < STORED}
    sql = ctx.captured_queries[-1]["sql"]  # as sent, its parameters inlined
    read = _rows_read(sql, None)
    assert read <= 2 * len(existing) + 10, (read, sql[:300])


def test_runs_become_ranges_and_the_rest_one_list():
    where = str(Rollout.objects.with_task_indices({1, 2, 3, 7, 10, 11, 40}).query).split("WHERE")[1]
    assert where.count("BETWEEN") + where.count(">=") == 2 and "IN (7, 40)" in where, where
    assert "IN (4)" in str(Rollout.objects.with_task_indices({4}).query)


@pytest.mark.django_db
def test_pairs_in_repeat_ranges_are_probes_whatever_the_statistics():
    """A chunk's completeness check and its pages ask for (task, repeats of one occurrence) pairs. Asked as an IN
    list with the repeat range, PostgreSQL read every stored row of the job in that range when it judged the range
    rare (statistics from early in the job): 50-120 ms a query at 400k stored rows, growing with the job."""
    if connection.vendor != "postgresql":
        pytest.skip("the plan is PostgreSQL's")
    from controlplane.jobs.chunk_tasks import stored_pairs_in_ranges

    owner = make_user("repeat-ranges")
    job = CollectionJob.objects.create(owner=owner, dataset=make_dataset(owner, n=3), endpoint=make_endpoint(owner),
                                       state="running", num_repeats=1, total_rollouts=40_000)
    # 2,000 distinct lines seen 20 times each: task t's k-th occurrence is its repeat index k. The statistics are
    # from before the job grew (autovacuum analyzes a growing table now and then), when another job's rows made
    # most of the table: the planner takes this job for a small one
    other = CollectionJob.objects.create(owner=owner, dataset=job.dataset, endpoint=job.endpoint, state="completed",
                                         num_repeats=1, total_rollouts=10_000)
    Rollout.objects.bulk_create([Rollout(job=other, task_index=t, rollout_index=0, status="ok", data={})
                                 for t in range(10_000)], batch_size=5000)
    Rollout.objects.bulk_create([Rollout(job=job, task_index=t, rollout_index=0, status="ok", data={})
                                 for t in range(100)])
    with connection.cursor() as cur:
        cur.execute("ANALYZE jobs_rollout")
    Rollout.objects.bulk_create([Rollout(job=job, task_index=t, rollout_index=k, status="ok", data={})
                                 for k in range(20) for t in range(2000) if k or t >= 100], batch_size=5000)
    tasks = list(range(3, 2000, 40))  # 50 scattered tasks at their 16th occurrence, and 5 not stored yet
    tasks_at = tasks + [2100, 2101, 2102, 2103, 2104]
    los, his = [15] * len(tasks_at), [16] * len(tasks_at)
    with CaptureQueriesContext(connection) as ctx:
        count = stored_pairs_in_ranges(job.pk, tasks_at, los, his, count=True)
        pairs = set(stored_pairs_in_ranges(job.pk, tasks_at, los, his))
    assert count == len(tasks) and pairs == {(t, 15) for t in tasks}
    for query in ctx.captured_queries:
        read = _rows_read(query["sql"], None)
        assert read <= 2 * len(tasks) + 10, (read, query["sql"][:300])
    # the question as it was asked before: the job's rows of that repeat, every task's, were read
    old = Rollout.objects.filter(job_id=job.pk, rollout_index__gte=15, rollout_index__lt=16, task_index__in=tasks_at)
    with CaptureQueriesContext(connection) as ctx:
        assert old.count() == len(tasks)
    old_read = _rows_read(ctx.captured_queries[-1]["sql"], None)
    assert old_read > 10 * len(tasks), f"the setup does not trap the planner ({old_read} rows read): it proves nothing"
