"""The end-of-job summary in constant memory (issue 28, worker memory flat): `compute_summaries` keeps running
sums in the worker and asks the database for medians and percentiles. Its figures must be the ones the
engine's in-memory accumulators give over the same rows (the CLI drop-in's, and this code's before), on
PostgreSQL (the suite's database) and on SQLite (the laptop default, in a subprocess on a fresh file)."""
from __future__ import annotations

import math

import pytest

from tests.sqlite_child import run_on_sqlite



def build_job(n=360, seed=7):
    """A job of n rollouts, 3 repeats a task: failures, None timings, ties, integers, booleans, strings,
    usage counts under response.usage, some rows with a top-level input_tokens that wins over usage."""
    import random

    from controlplane.jobs.models import CollectionJob, Rollout
    from tests.factories import make_dataset, make_endpoint, make_user

    rng = random.Random(seed)
    owner = make_user(f"summary-{seed}-{rng.random()}")
    job = CollectionJob.objects.create(owner=owner, dataset=make_dataset(owner, n=3), endpoint=make_endpoint(owner),
                                       state="running", num_repeats=3, total_rollouts=n)
    rows = []
    for i in range(n):
        task, rep = divmod(i, 3)
        failed = i % 11 == 5
        data = {"_ng_task_index": task, "_ng_rollout_index": rep, "question": f"q{task}"}
        if not failed:
            data.update(reward=rng.choice([0.0, 1.0, 1.0, 0.5]), extracted_answer=str(rng.randint(0, 2)),
                        score=rng.randint(-3, 3), latency_s=round(rng.lognormvariate(0, 1), 3),
                        flag=rng.random() < 0.5, label="x", noise=rng.gauss(0, 1e6),
                        response={"usage": {"input_tokens": rng.randint(5, 9), "output_tokens": rng.randint(1, 400),
                                            "total_tokens": 0,
                                            "output_tokens_details": {"reasoning_tokens": rng.randint(0, 3)}}})
            if i % 7 == 0:
                data["input_tokens"] = 1000 + i  # the row's own field counts, not the usage
            if i % 13 == 0:
                data["input_tokens"] = "n/a"  # present but not a number: neither counts
            if i % 17 == 0:
                data["rare"] = i * 0.1
                data['we"ird'] = float(i % 4)  # a key SQLite's JSON path cannot address
        timing = lambda: None if rng.random() < 0.2 else float(rng.choice([1, 2, 2, 3, rng.uniform(0, 500)]))  # noqa: E731
        rows.append(Rollout(job=job, task_index=task, rollout_index=rep, status="failed" if failed else "ok",
                            failure_class="http_429" if failed else "", reward=data.get("reward"), data=data,
                            queue_ms=timing(), ttft_ms=timing(), generation_ms=timing(), verify_ms=None,
                            wall_ms=timing()))
    Rollout.objects.bulk_create(rows, batch_size=500)
    return job


def old_summaries(job):
    """The figures as computed before: every value in memory (the engine's accumulators, keep_values)."""
    from controlplane.jobs.models import Rollout
    from workers.engine.aggregate import AggregateAccumulator, TimingAccumulator
    from workers.engine.types import TIMING_FIELDS

    agg, timing = AggregateAccumulator(ordered_by_task=True), TimingAccumulator()
    qs = (Rollout.objects.filter(job_id=job.pk).order_by("task_index", "rollout_index")
          .values_list("status", "data", *TIMING_FIELDS))
    for status, data, *timings in qs:
        timing.add(**dict(zip(TIMING_FIELDS, timings)))
        if status == "ok":
            agg.add(data)
    return agg.result(), timing.result()


def compare():
    """(differences, number of figures compared): std within 1e-12 relative (see RunningStats), the rest equal."""
    from controlplane.jobs.services import compute_summaries

    job = build_job()
    new, old = compute_summaries(job, batch_size=50), old_summaries(job)
    diffs, n = [], 0
    flat = lambda d: {f"{k}.{s}" if isinstance(v, dict) else k: (v[s] if isinstance(v, dict) else v)  # noqa: E731
                      for k, v in d.items() for s in (v if isinstance(v, dict) else [None])}
    for part_new, part_old in ((new[0], old[0]), (flat(new[1]), flat(old[1]))):
        if set(part_new) != set(part_old):
            diffs.append(("keys", sorted(set(part_new) ^ set(part_old))))
        for key in part_old:
            a, b = part_new.get(key), part_old[key]
            n += 1
            same = (a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)))
            if key.startswith("std/") and a is not None and b is not None:
                same = math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
            if not same:
                diffs.append((key, a, b))
    assert "median/input_tokens" in old[0] and "median/rare" in old[0] and 'median/we"ird' in old[0] and "p99" in old[1]["wall_ms"]
    return diffs, n


@pytest.mark.django_db
def test_summary_equals_in_memory_figures_on_postgresql():
    diffs, n = compare()
    assert n > 60 and not diffs, diffs


CHILD = r"""
import json
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from tests.controlplane.test_summary_constant_memory import compare
diffs, n = compare()
print("RESULT " + json.dumps({"diffs": repr(diffs), "n": n, "ok": not diffs}))
"""


@pytest.mark.slow
def test_summary_equals_in_memory_figures_on_sqlite(tmp_path):
    res = run_on_sqlite(CHILD, tmp_path)
    assert res["n"] > 60 and res["ok"], res


def _fed_summaries(job, order_seed=3, max_rows=100_000, skip=0):
    """A StoredRowSummaries fed the job's rows as the drop-in's on_stored does: out of order (shuffled),
    `skip` rows left out."""
    import random

    from controlplane.jobs.models import Rollout
    from controlplane.jobs.services import feed_summaries
    from workers.engine.aggregate import StoredRowSummaries
    from workers.engine.types import TIMING_FIELDS

    rows = list(Rollout.objects.filter(job_id=job.pk).values("status", "data", "rollout_index", *TIMING_FIELDS))
    random.Random(order_seed).shuffle(rows)
    summaries = StoredRowSummaries(max_rows=max_rows)
    for start in range(skip, len(rows), 37):  # in batches, as the sink stores them
        feed_summaries(summaries, rows[start:start + 37])
    return summaries


@pytest.mark.django_db
def test_summaries_fed_while_storing_equal_the_table_read_back():
    """The drop-in's summaries, fed with each batch as it is stored (out of order), are the figures reading
    the table back gives, to the last bit (majority@k's ties included); a table holding a row not fed, or a
    job past the bound, gives None (finalize_job then reads the table)."""
    from controlplane.jobs.models import Rollout
    from controlplane.jobs.services import compute_summaries

    job = build_job()
    stored = Rollout.objects.filter(job_id=job.pk).count()
    expected = compute_summaries(job)
    for seed in (1, 2, 3):
        got = _fed_summaries(job, order_seed=seed).result(stored)
        assert got is not None
        assert got[0] == expected[0] and got[1] == expected[1], seed
    assert "majority@3" in expected[0] and "pass@3" in expected[0]
    assert _fed_summaries(job, skip=1).result(stored) is None  # a row stored by someone else
    assert _fed_summaries(job, max_rows=stored - 1).result(stored) is None
