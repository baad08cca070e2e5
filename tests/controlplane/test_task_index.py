"""Task and rollout indices as ng_collect_rollouts (nemo-gym 0.4.0) assigns them: identical input lines share
one `_ng_task_index` and continue its rollout count; a row's own index is kept (and may be shared too).
The expected pairs below are what NeMo Gym's own `_preprocess_rows_from_config` gives for this file (the
`nemo_gym` test checks them against it); the job test collects the file with chunks that split the
identical lines, and a rerun stores nothing twice."""
from __future__ import annotations

import io
import json
import subprocess

import pytest
from django.db.models import Count

from controlplane.datasets.models import DatasetRow
from controlplane.datasets.services import ingest_jsonl, iter_task_rows
from controlplane.jobs import services
from controlplane.jobs.models import JobState, Rollout
from controlplane.jobs.runtime import run_job_inline
from tests.fixtures_simulator import REPO_ROOT
from workers.engine.materialize import materialize_tasks


def _row(q, **extra):
    return {"responses_create_params": {"input": [{"role": "user", "content": q}]}, "expected_answer": "2", **extra}


LINES = [json.dumps(r) for r in (
    _row("a", x=1), _row("b", x=2), _row("a", x=1),  # line 3 repeats line 1
    _row("c", _ng_task_index=0),  # its own index, the same as the first distinct line's
    _row("d"), _row("b", x=2),  # line 6 repeats line 2
)]
# ng_collect_rollouts +num_repeats=2 on LINES (seen with nemo-gym 0.4.0), in its order
NEMO_GYM_PAIRS = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (0, 4), (0, 5), (2, 0), (2, 1), (1, 2), (1, 3)]


def _ingest(owner=None):
    return ingest_jsonl(io.BytesIO(("\n".join(LINES) + "\n").encode()), name="dups", owner=owner)


@pytest.mark.django_db
def test_identical_lines_share_a_task_index_and_continue_its_rollouts():
    ds = _ingest()
    assert ds.row_count == 6 and ds.bad_line_count == 0  # nothing refused: NeMo Gym takes every line
    stored = list(DatasetRow.objects.filter(dataset=ds).order_by("index").values_list("task_index", "occurrence"))
    assert stored == [(0, 0), (1, 0), (0, 1), (0, 2), (2, 0), (1, 1)]
    items = list(materialize_tasks(iter_task_rows(ds), 2))
    assert [(i.task_index, i.rollout_index) for i in items] == NEMO_GYM_PAIRS
    assert len(set(NEMO_GYM_PAIRS)) == 12


@pytest.mark.django_db
@pytest.mark.parametrize("case", ["distinct", "own index", "repeat", "repeat past the bound"])
def test_ingest_numbers_rows_as_they_stream_and_in_the_database_past_a_bound(monkeypatch, case):
    """Rows are numbered as the file streams (TaskIndexer), with no pass over the stored rows; a file longer than
    the in-memory bound is numbered by number_tasks in the database. Either way the stored numbers are the ones
    NeMo Gym's rules give."""
    from controlplane.datasets import services as ds_services
    from workers.task_index import TaskIndexer

    lines = [json.dumps(_row(f"q{i}")) for i in range(12)]
    if case == "own index":
        lines[5] = json.dumps(_row("q5", _ng_task_index=3))
    elif case.startswith("repeat"):
        lines[9] = lines[2]
    if case == "repeat past the bound":
        monkeypatch.setattr(ds_services._RowWriter, "NUMBER_IN_MEMORY_MAX_ROWS", 4)  # rows 4.. get placeholders
    passes = []
    real = ds_services.number_tasks
    monkeypatch.setattr(ds_services, "number_tasks", lambda d: (passes.append(d.pk), real(d)))
    ds = ingest_jsonl(io.BytesIO(("\n".join(lines) + "\n").encode()), name=case)
    indexer = TaskIndexer()
    want = [indexer.assign(json.loads(line), line) for line in lines]
    stored = list(DatasetRow.objects.filter(dataset=ds).order_by("index").values_list("task_index", "occurrence"))
    assert stored == want
    assert passes == ([ds.pk] if case == "repeat past the bound" else [])
    if case != "distinct":
        assert want != [(i, 0) for i in range(12)]  # the numbers are not the rows' positions


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_job_on_identical_lines_stores_nemo_gyms_pairs_once(simulator, sim_endpoint):
    ds = _ingest()
    job = services.create_job(owner=None, dataset=ds, endpoint=sim_endpoint(simulator.base_url), num_repeats=2,
                              num_samples_in_parallel=4, chunk_size=2, launch=False)  # the repeats fall in other chunks
    job = run_job_inline(job)
    assert job.state == JobState.COMPLETED
    pairs = sorted(Rollout.objects.filter(job=job).values_list("task_index", "rollout_index"))
    assert pairs == sorted(NEMO_GYM_PAIRS)
    # the stored row of each pair is its own line's (line 4 is task 0's rollouts 4-5)
    contents = {(t, k): d["responses_create_params"]["input"][0]["content"]
                for t, k, d in Rollout.objects.filter(job=job).values_list("task_index", "rollout_index", "data")}
    assert [contents[(0, k)] for k in range(6)] == ["a", "a", "a", "a", "c", "c"]
    job = run_job_inline(job)  # the rerun resumes: nothing collected twice
    assert Rollout.objects.filter(job=job).count() == 12
    assert not Rollout.objects.filter(job=job).values("task_index", "rollout_index").annotate(n=Count("id")).filter(n__gt=1).exists()


NEMO_GYM_PREPROCESS = r"""
import json, sys
from nemo_gym.rollout_collection import RolloutCollectionConfig, RolloutCollectionHelper
cfg = RolloutCollectionConfig(agent_name="agent", input_jsonl_fpath=sys.argv[1], output_jsonl_fpath=sys.argv[2],
                              num_repeats=2)
rows = RolloutCollectionHelper._preprocess_rows_from_config(None, cfg)
print(json.dumps([[r["_ng_task_index"], r["_ng_rollout_index"]] for r in rows]))
"""


@pytest.mark.nemo_gym
def test_expected_pairs_are_nemo_gyms_own(tmp_path):
    script = REPO_ROOT / "scripts" / "nemo_gym.sh"
    if subprocess.run(["bash", str(script), "python"], capture_output=True, timeout=60).returncode == 3:
        pytest.skip("no Python >= 3.12 for nemo-gym")
    setup = subprocess.run(["bash", str(script), "setup"], capture_output=True, text=True, timeout=1200)
    assert setup.returncode == 0, setup.stderr[-3000:]
    inp = tmp_path / "tasks.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    res = subprocess.run([str(REPO_ROOT / ".venv-nemo-gym" / "bin" / "python"), "-c", NEMO_GYM_PREPROCESS, str(inp),
                          str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [tuple(p) for p in json.loads(res.stdout.strip().splitlines()[-1])] == NEMO_GYM_PAIRS
