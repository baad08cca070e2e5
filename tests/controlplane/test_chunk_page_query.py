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
