"""The product driving a real NeMo Gym deployment (`ng_run`: math_with_judge's simple agent, a second agent,
the vllm_model server in front of the simulator): the drop-in against ng_collect_rollouts, routing by
agent_ref, an agent's 500 recorded as a failure, an agent restarted mid-job, the remote /verify verifier."""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db.models import Count

from controlplane.jobs.models import CollectionJob, JobState, Rollout
from tests.fixtures_nemo_gym import AGENT, SECOND_AGENT

pytestmark = [pytest.mark.nemo_gym, pytest.mark.django_db(transaction=True)]


def write_tasks(path: Path, n: int, *, wrong_every: int = 3, agent_ref_every: int = 0, missing_answer: tuple = ()) -> Path:
    """Arithmetic rows. Every `wrong_every`-th row's expected_answer is off by one (reward 0 whatever the
    collection); `agent_ref_every`-th rows name the second agent; rows in `missing_answer` have no answer."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = 3 * i + 1, 7 * i + 2
            row = {"responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + {b}?"}]},
                   "question": f"What is {a} + {b}?", "expected_answer": str(a + b + (1 if wrong_every and i % wrong_every == 0 else 0)),
                   "id": f"t{i}"}
            if agent_ref_every and i % agent_ref_every == 1:
                row["agent_ref"] = {"name": SECOND_AGENT}
            if i in missing_answer:
                del row["expected_answer"]
            f.write(json.dumps(row) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def ng_args(ng, inp, out, *extra):
    return [f"+agent_name={AGENT}", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}", "+num_repeats=2",
            "+num_samples_in_parallel=8", f"+head_server.host={ng.head_host}", f"+head_server.port={ng.head_port}",
            "+responses_create_params.max_output_tokens=64", *extra]


def key(r):
    return r["_ng_task_index"], r["_ng_rollout_index"]


def collect_both(ng, inp, tmp_path, capsys):
    """The same tasks through NeMo Gym's ng_collect_rollouts (into tmp_path/ng) and the drop-in (into
    tmp_path/ours). Returns (their rows sorted by (task, rollout), ours as written, what the drop-in printed)."""
    (tmp_path / "ng").mkdir()
    # seeded: the simulator samples each repeat of a prompt by its seed, not by how often it saw the prompt before
    # (the first tool's requests would otherwise shift the second's samples)
    seeded = "+num_repeats_add_seed=true"
    res = subprocess.run([str(ng.venv_bin / "ng_collect_rollouts"), *ng_args(ng, inp, tmp_path / "ng" / "rollouts.jsonl"),
                          seeded],
                         cwd=str(tmp_path), env=ng.env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    theirs = sorted(read_jsonl(tmp_path / "ng" / "rollouts.jsonl"), key=key)
    call_command("collect_rollouts", *ng_args(ng, inp, tmp_path / "ours" / "rollouts.jsonl"), seeded)
    # both append in the order rollouts finish
    return theirs, sorted(read_jsonl(tmp_path / "ours" / "rollouts.jsonl"), key=key), capsys.readouterr().out


def test_drop_in_gives_the_rows_of_ng_collect_rollouts(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 12)
    theirs, ours, printed = collect_both(nemo_gym, inp, tmp_path, capsys)
    assert "24 ok, 0 failed of 24" in printed

    assert len(theirs) == len(ours) == 24
    assert [key(r) for r in ours] == [key(r) for r in theirs] == [(t, k) for t in range(12) for k in range(2)]
    fields = ("reward", "extracted_answer", "library_reward", "expected_answer", "agent_ref", "id")
    for mine, ref in zip(ours, theirs):
        assert {f: mine.get(f) for f in fields} == {f: ref.get(f) for f in fields}, key(mine)
    rewards = [r["reward"] for r in ours]
    assert rewards.count(0.0) == 8 and rewards.count(1.0) == 16  # rows 0, 3, 6, 9 carry a wrong answer
    assert ours[0]["response"]["usage"]["output_tokens"] > 0
    assert set(ours[0]) - {"failure_class", "error"} >= set(theirs[0]) - {"skills_ref"}

    # the same four files as NeMo Gym
    for name in ("rollouts.jsonl", "rollouts_failures.jsonl", "rollouts_materialized_inputs.jsonl",
                 "rollouts_aggregate_metrics.json"):
        assert (tmp_path / "ng" / name).exists() and (tmp_path / "ours" / name).exists(), name
    mat_ours = read_jsonl(tmp_path / "ours" / "rollouts_materialized_inputs.jsonl")
    mat_theirs = sorted(read_jsonl(tmp_path / "ng" / "rollouts_materialized_inputs.jsonl"), key=key)
    assert mat_ours == mat_theirs
    agg_ours = json.loads((tmp_path / "ours" / "rollouts_aggregate_metrics.json").read_text())
    agg_theirs = json.loads((tmp_path / "ng" / "rollouts_aggregate_metrics.json").read_text())
    assert [e["agent_ref"] for e in agg_ours] == [e["agent_ref"] for e in agg_theirs] == [{"name": AGENT}]
    assert agg_ours[0]["agent_metrics"] == agg_theirs[0]["agent_metrics"]
    job = CollectionJob.objects.get()
    assert job.aggregate_metrics["mean/reward"] == pytest.approx(16 / 24)  # the product's own, beside the agent's
    assert job.endpoint.kind == "nemo_gym" and job.endpoint.model_name == AGENT

    # rerunning the same command resumes the same (completed) job: nothing collected twice
    call_command("collect_rollouts", *ng_args(nemo_gym, inp, tmp_path / "ours" / "rollouts.jsonl"),
                 "+num_repeats_add_seed=true")
    assert "already completed" in capsys.readouterr().err
    assert CollectionJob.objects.count() == 1 and Rollout.objects.count() == 24


def test_identical_lines_and_repeated_indices_match_ng_collect_rollouts(nemo_gym, tmp_path, capsys):
    """Identical lines share a task index and continue its rollout indices; a row's own index is kept and
    shared too: the same (task, rollout) pairs, rows and rewards as NeMo Gym's, and the agent's timing split."""
    base = write_tasks(tmp_path / "base.jsonl", 5).read_text().splitlines()
    explicit = json.loads(base[4])
    explicit["_ng_task_index"] = 1
    lines = [base[0], base[1], base[0], base[2], json.dumps(explicit), base[3], base[1]]
    inp = tmp_path / "tasks.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    theirs, ours, printed = collect_both(nemo_gym, inp, tmp_path, capsys)
    assert "14 ok, 0 failed of 14" in printed
    assert [key(r) for r in ours] == [key(r) for r in theirs]
    assert sorted(key(r) for r in ours) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5),
                                            (2, 0), (2, 1), (3, 0), (3, 1)]
    for mine, ref in zip(ours, theirs):
        assert {f: mine.get(f) for f in ("reward", "id", "expected_answer")} == \
            {f: ref.get(f) for f in ("reward", "id", "expected_answer")}, key(mine)
    # both in NeMo Gym's materialization order (the file's lines, each with its repeats)
    mat_ours = read_jsonl(tmp_path / "ours" / "rollouts_materialized_inputs.jsonl")
    assert mat_ours == read_jsonl(tmp_path / "ng" / "rollouts_materialized_inputs.jsonl")
    assert [key(r) for r in mat_ours][:6] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]
    # the job's ticks split each /run: one model request per rollout (simple_agent on arithmetic), seen on the
    # model server's /metrics (the simulator behind vllm_model)
    from controlplane.diagnostics.services import job_ticks
    from workers.diagnosis.evidence import build_evidence

    ev = build_evidence(job_ticks(CollectionJob.objects.get()))
    assert ev.agent_job and ev.agent_run_ms > 0 and ev.agent_model_calls == pytest.approx(1.0, abs=0.01)


def test_rows_route_by_agent_ref_and_a_500_is_a_failure_not_a_stop(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 10, wrong_every=0, agent_ref_every=2, missing_answer=(4,))
    out = tmp_path / "o" / "rollouts.jsonl"
    call_command("collect_rollouts", *ng_args(nemo_gym, inp, out, "+max_retries=1"))
    text = capsys.readouterr().out
    assert "18 ok, 2 failed of 20" in text and "http_5xx=2" in text
    job = CollectionJob.objects.get()
    assert job.state == JobState.COMPLETED
    ok = read_jsonl(out)
    assert len(ok) == 18
    assert all(isinstance(r["reward"], float) and "library_reward" in r for r in ok)  # scored by the agent's server
    routed = {r["_ng_task_index"]: r["agent_ref"]["name"] for r in ok}
    assert {t for t, a in routed.items() if a == SECOND_AGENT} == {1, 3, 5, 7, 9}
    assert {t for t, a in routed.items() if a == AGENT} == {0, 2, 6, 8}
    failed = sorted(read_jsonl(out.with_name("rollouts_failures.jsonl")), key=key)
    assert [key(r) for r in failed] == [(4, 0), (4, 1)]
    assert all(r["failure_class"] == "http_5xx" and "HTTP 500" in r["error"] for r in failed)
    agg = json.loads(out.with_name("rollouts_aggregate_metrics.json").read_text())
    assert sorted(e["agent_ref"]["name"] for e in agg) == sorted([AGENT, SECOND_AGENT])
    assert all("error" not in e for e in agg)


def test_agent_restarted_mid_job_gives_exactly_one_row_per_pair(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 60, wrong_every=0)
    out = tmp_path / "o" / "rollouts.jsonl"
    nemo_gym.sim.configure(ttft_ms=400)
    errors: list[BaseException] = []

    def run():
        try:
            call_command("collect_rollouts", *ng_args(nemo_gym, inp, out, "+num_repeats=1", "+max_retries=40"),
                         "+num_samples_in_parallel=4")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            from django.db import connection

            connection.close()

    before = {s.name: s.url for s in nemo_gym.deployment().servers.values()}
    worker = threading.Thread(target=run)
    try:
        worker.start()
        deadline = time.monotonic() + 120
        while Rollout.objects.count() < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 8 <= Rollout.objects.count() < 60, "the job should be mid-way when the deployment goes down"
        nemo_gym.restart()  # ng_run stopped (SIGINT) and started again: the agents come back on new ports
        nemo_gym.sim.configure(ttft_ms=0)
        worker.join(timeout=400)
    finally:
        nemo_gym.sim.configure(ttft_ms=0)
    assert not worker.is_alive() and not errors, errors
    after = {s.name: s.url for s in nemo_gym.deployment().servers.values()}
    assert after[AGENT] != before[AGENT]
    job = CollectionJob.objects.get()
    failures = list(Rollout.objects.filter(status=Rollout.Status.FAILED).values_list("failure_class", "error"))
    assert job.state == JobState.COMPLETED and job.completed_count == 60 and failures == []
    assert not Rollout.objects.values("task_index", "rollout_index").annotate(c=Count("id")).filter(c__gt=1).exists()
    assert sorted(key(r) for r in read_jsonl(out)) == [(t, 0) for t in range(60)]
    assert Rollout.objects.filter(attempts__gt=1).exists()  # some rows were retried across the restart


def test_remote_verifier_scores_the_products_generations(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 9)
    out = tmp_path / "o" / "rollouts.jsonl"
    call_command("collect_rollouts", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}", "+num_repeats=1",
                 f"+model_base_url={nemo_gym.sim.base_url}", f"+model_name={nemo_gym.sim.model}",
                 "+responses_create_params.max_output_tokens=64", "+verifier=nemo_gym",
                 f"+verifier_options.head_url={nemo_gym.head_url}", "+verifier_options.server=math_with_judge")
    assert "9 ok, 0 failed of 9" in capsys.readouterr().out
    rows = sorted(read_jsonl(out), key=key)
    assert [r["reward"] for r in rows] == [0.0 if i % 3 == 0 else 1.0 for i in range(9)]
    assert all("library_reward" in r and r["extracted_answer"] for r in rows)  # math_with_judge's own fields
    assert all(r["verify_ms"] is not None for r in Rollout.objects.all().values("verify_ms"))
