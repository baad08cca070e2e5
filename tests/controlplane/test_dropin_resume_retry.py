"""The same collect_rollouts command rerun with +resume_from_cache=true after a run that completed with failed
rollouts, as nemo-gym 0.4.0's ng_collect_rollouts (rollout_collection.py, _load_from_cache and run_from_config):

- each failed rollout is collected again while `<out>_failures.jsonl` (the ledger: one line per failed attempt)
  holds fewer than NEMO_GYM_MAX_ROLLOUT_ATTEMPTS lines for it and none marks it `_ng_failure_terminal`;
- a success is appended to `<out>.jsonl` (one line per rollout, nothing rewritten), a failure adds a ledger line;
- an agent's `_ng_no_persist` failure (kill-shaped) is written to neither file and is retried by the next resume.
"""

from __future__ import annotations

import json

import pytest

from controlplane.jobs.models import CollectionJob, JobState, Rollout
from tests.controlplane.test_dropin_nemo_gym_sim import FakeNemoGym, run_cli

pytestmark = pytest.mark.django_db(transaction=True)


RFC = ("+max_retries=0", "+resume_from_cache=true")  # the same command each time, as a chain-hop script runs it


def keys(path):
    return sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in map(json.loads, path.read_text().splitlines()))


ALL = [(t, k) for t in range(6) for k in range(2)]


def test_rerun_with_resume_from_cache_retries_the_failed_rollouts_of_the_completed_job(tmp_path, capsys):
    out, fails = tmp_path / "rollouts.jsonl", tmp_path / "rollouts_failures.jsonl"
    with FakeNemoGym(tmp_path / "ng", fail_tasks={1, 4}) as ng:
        run_cli(ng, tmp_path, out, *RFC)
        job = CollectionJob.objects.get()
        assert job.state == JobState.COMPLETED and job.failed_count == 4
        first_out, ledger = out.read_text(), fails.read_text()
        assert len(first_out.splitlines()) == 8 and keys(fails) == [(1, 0), (1, 1), (4, 0), (4, 1)]
        capsys.readouterr()

        ng.fail_tasks = {4}  # task 1 now succeeds, task 4 fails again
        runs = ng.calls["run"]
        run_cli(ng, tmp_path, out, *RFC)
        assert ng.calls["run"] - runs >= 4  # the four failed rollouts, and nothing else, were sent again
        printed = capsys.readouterr()
        assert CollectionJob.objects.get().pk == job.pk, "the same command resumes the same job"
        assert f"Resume from cache: job {job.pk} retries 4 failed rollout(s)" in printed.err, printed.err
        assert "Retried: 4 failed rollout(s): 2 ok now, 2 failed again" in printed.out, printed.out
        assert f"Job {job.pk} completed: 10 ok, 2 failed of 12" in printed.out
        text = out.read_text()
        assert text.startswith(first_out) and len(text.splitlines()) == 10, "only the new lines are appended"
        assert keys(out) == sorted(set(ALL) - {(4, 0), (4, 1)}), "one line per rollout"
        assert fails.read_text().startswith(ledger) and keys(fails) == [(1, 0), (1, 1), (4, 0), (4, 0), (4, 1), (4, 1)]

        run_cli(ng, tmp_path, out, *RFC)  # third attempt of task 4: still under the cap
        assert keys(fails).count((4, 0)) == 3
        capsys.readouterr()
        runs = ng.calls["run"]
        run_cli(ng, tmp_path, out, *RFC)
        printed = capsys.readouterr()
        assert ng.calls["run"] == runs, "3 ledger lines each: NeMo Gym's cap, nothing is sent"
        assert "retries 0 failed rollout(s)" in printed.err and "2 at NEMO_GYM_MAX_ROLLOUT_ATTEMPTS=3" in printed.err
        assert keys(fails).count((4, 0)) == 3 and len(out.read_text().splitlines()) == 10
        assert Rollout.objects.filter(job=job).count() == 12


def test_rerun_without_resume_from_cache_leaves_a_completed_job_alone(tmp_path, capsys):
    out = tmp_path / "rollouts.jsonl"
    with FakeNemoGym(tmp_path / "ng", fail_tasks={2}) as ng:
        run_cli(ng, tmp_path, out, "+max_retries=0")
        ng.fail_tasks.clear()
        runs = ng.calls["run"]
        run_cli(ng, tmp_path, out, "+max_retries=0")
    assert ng.calls["run"] == runs and "already completed" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 10


def test_terminal_failures_are_not_retried_and_no_persist_ones_are_written_nowhere(tmp_path, capsys):
    out, fails = tmp_path / "rollouts.jsonl", tmp_path / "rollouts_failures.jsonl"
    with FakeNemoGym(tmp_path / "ng") as ng:
        ng.marks = {
            2: {"_ng_failure_class": "timeout_exceeded", "_ng_failure_terminal": True},
            3: {"_ng_no_persist": True, "_ng_failure_class": "kill_shaped"},
            5: {"_ng_no_persist": True},
        }
        run_cli(ng, tmp_path, out, *RFC)
        job = CollectionJob.objects.get()
        assert job.failed_count == 6 and job.completed_count == 6
        assert keys(fails) == [(2, 0), (2, 1)], "a _ng_no_persist failure goes to no file"
        assert keys(out) == [(t, k) for t in (0, 1, 4) for k in range(2)]
        assert all(r["_ng_failure_terminal"] is True for r in map(json.loads, fails.read_text().splitlines()))
        assert (
            "Not in the failures file: 4 failed rollout(s) the agent marked _ng_no_persist" in capsys.readouterr().out
        )

        ng.marks = {2: {}}  # task 2 would succeed now, but its failure was terminal; 3 and 5 succeed now
        runs = ng.calls["run"]
        run_cli(ng, tmp_path, out, *RFC)
        printed = capsys.readouterr()
        sent = ng.calls["run"]
        run_cli(ng, tmp_path, out, *RFC, "+resume=false")  # a fresh job reads the same files (import_cache)
        assert ng.calls["run"] == sent, "a fresh job does not retry a terminal failure either"
        assert CollectionJob.objects.order_by("-pk").first().failed_count == 2
    assert sent - runs == 4, "the four _ng_no_persist rollouts, not the terminal ones"
    assert "retries 4 failed rollout(s)" in printed.err and "2 marked _ng_failure_terminal" in printed.err
    assert "Retried: 4 failed rollout(s): 4 ok now, 0 failed again" in printed.out, printed.out
    assert keys(out) == sorted(set(ALL) - {(2, 0), (2, 1)}) and keys(fails) == [(2, 0), (2, 1)]
