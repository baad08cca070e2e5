"""Export: NeMo Gym JSONL lines in (task, repeat) order, failures apart, constant memory."""
import json
import time
import tracemalloc

import pytest
from django.core.management import call_command
from django.db import connection

from controlplane.datasets.models import Dataset
from controlplane.endpoints.models import Endpoint
from controlplane.jobs.export import export_paths, iter_export_lines, write_export
from controlplane.jobs.models import CollectionJob, Rollout

pytestmark = pytest.mark.django_db


@pytest.fixture
def export_job(db):
    def make(name="exp"):
        ds = Dataset.objects.create(name=f"{name}-ds", status="ready", row_count=1)
        ep = Endpoint.objects.create(name=f"{name}-ep", base_url="http://127.0.0.1:9", model_name="m")
        return CollectionJob.objects.create(name=name, dataset=ds, endpoint=ep, state="completed",
                                            aggregate_metrics={"mean/reward": 0.5, "pass@2": 0.75})
    return make


def insert_rollouts_sql(job, n_tasks, repeats=2, fail_every=0):
    """Insert n_tasks*repeats realistic output rows server-side (generate_series), in shuffled id order."""
    table = Rollout._meta.db_table
    fail_expr = f"(mod(t, {fail_every}) = 0)" if fail_every else "false"
    sql = f"""
    INSERT INTO {table} (job_id, task_index, rollout_index, status, failure_class, error, reward, data, attempts,
                         weight_version, worker, created_at)
    SELECT %s, t, r,
           CASE WHEN {fail_expr} THEN 'failed' ELSE 'ok' END,
           CASE WHEN {fail_expr} THEN 'http_5xx' ELSE '' END,
           CASE WHEN {fail_expr} THEN 'HTTP 503 after 5 retries' ELSE '' END,
           CASE WHEN {fail_expr} THEN NULL ELSE mod(t, 2)::float END,
           jsonb_build_object(
             'responses_create_params', jsonb_build_object('input', jsonb_build_array(
                 jsonb_build_object('role', 'user', 'content', 'What is ' || t || ' + ' || t || '? Think step by step.'))),
             'question', 'What is ' || t || ' + ' || t || '?', 'expected_answer', (2 * t)::text,
             'response', jsonb_build_object('id', 'resp_' || t || '_' || r, 'status', 'completed',
                 'output', jsonb_build_array(jsonb_build_object('type', 'message', 'role', 'assistant',
                     'content', jsonb_build_array(jsonb_build_object('type', 'output_text',
                         'text', 'Adding the two numbers gives \\boxed{{' || (2 * t) || '}}.')))),
                 'usage', jsonb_build_object('input_tokens', 20, 'output_tokens', 12, 'total_tokens', 32)),
             'reward', mod(t, 2)::float, 'extracted_answer', (2 * t)::text,
             '_ng_task_index', t, '_ng_rollout_index', r),
           1, '', 'w', now()
    FROM generate_series(0, %s - 1) AS t, generate_series(0, %s - 1) AS r
    ORDER BY md5(t::text || r::text)
    """
    with connection.cursor() as cur:
        cur.execute(sql, [job.pk, n_tasks, repeats])


def test_lines_order_shape_and_failures(export_job, tmp_path):
    job = export_job()
    insert_rollouts_sql(job, 50, repeats=2, fail_every=10)
    ok = [json.loads(line) for line in iter_export_lines(job, "ok")]
    failed = [json.loads(line) for line in iter_export_lines(job, "failed")]
    assert len(ok) == 90 and len(failed) == 10
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in ok]
    assert keys == sorted(keys)
    assert ok[0]["response"]["output"][0]["content"][0]["text"].endswith("\\boxed{2}.")
    assert {"reward", "responses_create_params", "question", "expected_answer", "response"} <= set(ok[0])
    assert "failure_class" not in ok[0]
    assert all(r["failure_class"] == "http_5xx" and "503" in r["error"] for r in failed)
    assert [r["_ng_task_index"] for r in failed][:4] == [0, 0, 10, 10]

    res = write_export(job, tmp_path / "out" / "rollouts.jsonl")
    p = export_paths(tmp_path / "out" / "rollouts.jsonl")
    assert res["ok_rows"] == 90 and res["failed_rows"] == 10
    assert p["failures"].name == "rollouts_failures.jsonl"
    assert p["aggregate_metrics"].name == "rollouts_aggregate_metrics.json"
    assert sum(1 for _ in open(p["output"])) == 90 and sum(1 for _ in open(p["failures"])) == 10
    assert json.loads(p["aggregate_metrics"].read_text()) == {"mean/reward": 0.5, "pass@2": 0.75}
    assert not list((tmp_path / "out").glob(".*tmp*"))


def test_export_job_command(export_job, tmp_path, capsys):
    job = export_job()
    insert_rollouts_sql(job, 5, repeats=1, fail_every=5)
    call_command("export_job", str(job.pk))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and json.loads(out[0])["_ng_task_index"] == 1
    call_command("export_job", str(job.pk), "--failures")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and json.loads(out[0])["failure_class"] == "http_5xx"
    call_command("export_job", str(job.pk), "--out", str(tmp_path / "x.jsonl"))
    assert (tmp_path / "x_failures.jsonl").exists() and (tmp_path / "x_aggregate_metrics.json").exists()


def _export_peak(job):
    tracemalloc.start()
    n = 0
    t0 = time.perf_counter()
    try:
        for _line in iter_export_lines(job, "ok"):
            n += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return n, peak, time.perf_counter() - t0


@pytest.mark.slow
def test_export_memory_constant_20k_vs_200k(export_job):
    """Peak Python allocation streaming 20k vs 200k rollouts: flat (server-side cursor, 2000-row chunks)."""
    small, big = export_job("small"), export_job("big")
    insert_rollouts_sql(small, 10_000, repeats=2)
    insert_rollouts_sql(big, 100_000, repeats=2)
    n_s, peak_s, t_s = _export_peak(small)
    n_b, peak_b, t_b = _export_peak(big)
    print(f"\nexport peak: 20k rollouts {peak_s / 2**20:.2f} MiB ({t_s:.1f}s); "
          f"200k rollouts {peak_b / 2**20:.2f} MiB ({t_b:.1f}s)")
    assert n_s == 20_000 and n_b == 200_000
    assert peak_b < 1.5 * peak_s + 1 * 2**20, (peak_s, peak_b)
