"""Every key of nemo-gym 0.4.0's ng_collect_rollouts through both tools against a real deployment (`ng_run`:
math_with_judge's simple agent and a second agent, the simulator as the policy model, every answer right and no
jitter, so a reward depends only on the row): the same command line gives the same (task, rollout) pairs, the
same keys and the same rewards, and the keys that cannot apply here say so once while the run goes on."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from django.core.management import call_command

from controlplane.jobs.models import CollectionJob
from tests.fixtures_nemo_gym import AGENT, SECOND_AGENT
from tests.integration.test_nemo_gym import key, read_jsonl, write_tasks

pytestmark = [pytest.mark.nemo_gym, pytest.mark.django_db(transaction=True)]

FIELDS = ("reward", "id", "expected_answer", "agent_ref", "responses_create_params", "skills_ref", "extracted_answer")


def base_args(ng, inp, out):
    return [f"+agent_name={AGENT}", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
            f"+head_server.host={ng.head_host}", f"+head_server.port={ng.head_port}",
            "+responses_create_params.max_output_tokens=64"]


def run_ng(ng, inp, out, *extra, cwd=None):
    out.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([str(ng.venv_bin / "ng_collect_rollouts"), *base_args(ng, inp, out), *extra],
                         cwd=str(cwd or out.parent), env=ng.env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def run_ours(ng, inp, out, capsys, *extra):
    call_command("collect_rollouts", *base_args(ng, inp, out), *extra)
    got = capsys.readouterr()
    return got.out + got.err


def both(ng, inp, tmp_path, capsys, *extra):
    """The same command line through ng_collect_rollouts (tmp_path/ng) and the drop-in (tmp_path/ours): (their
    rows and ours, each sorted by (task, rollout), what the drop-in printed). Seeded (+num_repeats_add_seed): the
    simulator samples a repeat by its seed, not by how often it saw the prompt (the first tool's requests would
    shift the second's samples)."""
    if "+num_repeats_add_seed=true" not in extra:
        extra = (*extra, "+num_repeats_add_seed=true")
    run_ng(ng, inp, tmp_path / "ng" / "rollouts.jsonl", *extra)
    printed = run_ours(ng, inp, tmp_path / "ours" / "rollouts.jsonl", capsys, *extra)
    theirs = sorted(read_jsonl(tmp_path / "ng" / "rollouts.jsonl"), key=key)
    ours = sorted(read_jsonl(tmp_path / "ours" / "rollouts.jsonl"), key=key)
    return theirs, ours, printed


def server_verify_failed(row) -> bool:
    """math_with_judge answers (0.0, None) when its forked math-verify child dies or misses its deadline, which
    happens now and then on a loaded machine, to either tool: the reward is then the server's failure, not the
    row's."""
    return row.get("reward") == 0.0 and row.get("extracted_answer") is None


def assert_same(theirs, ours):
    assert [key(r) for r in ours] == [key(r) for r in theirs]
    excused = 0
    for mine, ref in zip(ours, theirs):
        fields = FIELDS
        if server_verify_failed(mine) != server_verify_failed(ref):
            excused += 1
            fields = tuple(f for f in FIELDS if f not in ("reward", "extracted_answer"))
        assert {f: mine.get(f) for f in fields} == {f: ref.get(f) for f in fields}, key(mine)
        assert set(ref) <= set(mine), (key(mine), set(ref) - set(mine))
    assert excused <= 1, f"{excused} rows scored by a failed server-side verification"


def same_materialized(tmp_path):
    mat = "rollouts_materialized_inputs.jsonl"
    return (sorted(read_jsonl(tmp_path / "ours" / mat), key=key)
            == sorted(read_jsonl(tmp_path / "ng" / mat), key=key))


def test_num_repeats_per_agent_with_default(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 6, agent_ref_every=2)  # rows 1, 3, 5 name the second agent
    theirs, ours, printed = both(nemo_gym, inp, tmp_path, capsys, f"+num_repeats={{{AGENT}: 3, _default: 1}}")
    assert_same(theirs, ours)
    assert sorted(key(r) for r in ours if r["agent_ref"]["name"] == SECOND_AGENT) == [(1, 0), (3, 0), (5, 0)]
    assert len(ours) == 3 * 3 + 3 * 1 and "12 ok, 0 failed of 12" in printed
    assert same_materialized(tmp_path)
    job = CollectionJob.objects.get()
    assert job.total_rollouts == 12 and job.collection_options["repeats_by_agent"] == {AGENT: 3, "_default": 1}


def test_num_repeats_dict_missing_an_agent_is_refused_as_ng_does(nemo_gym, tmp_path, capsys):
    from django.core.management.base import CommandError

    inp = write_tasks(tmp_path / "tasks.jsonl", 4, agent_ref_every=2)
    with pytest.raises(CommandError, match=r"num_repeats dict has no entry for agents \['math_second_agent'\]"):
        run_ours(nemo_gym, inp, tmp_path / "ours" / "rollouts.jsonl", capsys, f"+num_repeats.{AGENT}=2")


def test_num_repeats_add_seed_sends_each_rollout_its_seed(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 4)
    theirs, ours, printed = both(nemo_gym, inp, tmp_path, capsys, "+num_repeats=3", "+num_repeats_add_seed=true")
    assert_same(theirs, ours)  # responses_create_params included: metadata.extra_body carries the seed
    assert [json.loads(r["responses_create_params"]["metadata"]["extra_body"])["seed"] for r in ours] == [0, 1, 2] * 4
    assert same_materialized(tmp_path) and "Adding unique `seed` values" in printed


def test_prompt_config_builds_the_input_from_the_template(nemo_gym, tmp_path, capsys):
    inp = tmp_path / "tasks.jsonl"
    with open(inp, "w") as f:
        for i in range(5):
            a, b = 3 * i + 1, 7 * i + 2
            f.write(json.dumps({"question": f"What is {a} + {b}?", "expected_answer": str(a + b), "id": f"p{i}",
                                "responses_create_params": {"temperature": 0.0}}) + "\n")
    prompt = tmp_path / "prompt.yaml"
    prompt.write_text("system: Answer with the number only.\nuser: '{question}'\n")
    theirs, ours, printed = both(nemo_gym, inp, tmp_path, capsys, f"+prompt_config={prompt}", "+num_repeats=2")
    assert_same(theirs, ours)
    assert [(m["role"], m["content"]) for m in ours[0]["responses_create_params"]["input"]] == [
        ("system", "Answer with the number only."), ("user", "What is 1 + 2?")]
    assert all(r["reward"] == 1.0 for r in ours if not server_verify_failed(r)) and same_materialized(tmp_path)


def test_limit_skills_aggregation_and_keys_that_do_not_apply(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 8)
    skills = tmp_path / "skills"
    (skills / "adder").mkdir(parents=True)
    (skills / "adder" / "SKILL.md").write_text("---\nname: adder\ndescription: adds two numbers\n---\nAdd them.\n")
    extra = ("+limit=5", f"+skills.path={skills}", "+disable_aggregation=true", "+upload_rollouts_to_wandb=true",
             "+split=train", "+rollout_collection_driver=my.module:collect")
    theirs, ours, printed = both(nemo_gym, inp, tmp_path, capsys, *extra)
    assert_same(theirs, ours)
    assert len(ours) == 5 and ours[0]["skills_ref"]["hash"] and ours[0]["skills_ref"]["skills"][0]["name"] == "adder"
    for name in ("ng", "ours"):  # +disable_aggregation: no aggregate metrics file
        assert not (tmp_path / name / "rollouts_aggregate_metrics.json").exists(), name
    # nor any /aggregate_metrics call to the agents (NeMo Gym skips _call_aggregate_metrics entirely)
    job = CollectionJob.objects.get()
    assert job.collection_options.get("disable_aggregation") and "nemo_gym_agents" not in job.aggregate_metrics
    for k in ("upload_rollouts_to_wandb", "split", "rollout_collection_driver"):  # said once, the run went on
        assert printed.count(f"Note: +{k} is not applied") == 1, printed
    # +limit=0 is no limit, as in NeMo Gym
    run_ours(nemo_gym, inp, tmp_path / "all" / "rollouts.jsonl", capsys, "+limit=0")
    assert len(read_jsonl(tmp_path / "all" / "rollouts.jsonl")) == 8


def test_resume_from_cache_collects_only_what_the_file_lacks(nemo_gym, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 8)
    run_ng(nemo_gym, inp, tmp_path / "full" / "rollouts.jsonl", "+num_repeats=2", "+num_repeats_add_seed=true")
    full = (tmp_path / "full" / "rollouts.jsonl").read_text().splitlines()
    for name in ("ng", "ours"):  # an interrupted run: its first 6 rollouts on disk, and its materialized inputs
        (tmp_path / name).mkdir()
        (tmp_path / name / "rollouts.jsonl").write_text("\n".join(full[:6]) + "\n")
        shutil.copy(tmp_path / "full" / "rollouts_materialized_inputs.jsonl", tmp_path / name)
    theirs, ours, printed = both(nemo_gym, inp, tmp_path, capsys, "+num_repeats=2", "+resume_from_cache=true")
    assert_same(theirs, ours)
    assert len(ours) == 16 and "This run: 10 rollouts" in printed
    lines = (tmp_path / "ours" / "rollouts.jsonl").read_text().splitlines()
    assert lines[:6] == full[:6] and len(lines) == len(set(lines)) == 16  # appended, nothing twice


def test_default_parallelism_is_unbounded_and_capped_by_the_products_limit(nemo_gym, tmp_path, capsys, settings):
    inp = write_tasks(tmp_path / "tasks.jsonl", 6)
    printed = run_ours(nemo_gym, inp, tmp_path / "a" / "rollouts.jsonl", capsys, "+num_repeats=2", "+prewarm=2")
    assert "Parallelism: 12 requests in flight at most" in printed  # every rollout at once, as NeMo Gym's default
    assert "Pre-warm: 2/2 ok" in printed  # through the agent's POST /run (a model server URL would 404 there)
    settings.JOBS_MAX_PARALLELISM = 4
    printed = run_ours(nemo_gym, inp, tmp_path / "b" / "rollouts.jsonl", capsys, "+num_repeats=3")
    assert ("Parallelism: 4 requests in flight at most (NeMo Gym default: unbounded; capped by "
            "JOBS_MAX_PARALLELISM=4)") in printed
    assert len(read_jsonl(tmp_path / "b" / "rollouts.jsonl")) == 18


def test_profiling_enabled_against_a_deployment_names_its_servers(nemo_gym, tmp_path, capsys):
    """ng_run here runs without +profiling_enabled: the run goes on, and each of the deployment's servers is named
    as not profiling itself (its /stats, within the job's deployment, answers 404)."""
    inp = write_tasks(tmp_path / "tasks.jsonl", 3)
    printed = run_ours(nemo_gym, inp, tmp_path / "o" / "rollouts.jsonl", capsys, "+profiling_enabled=true",
                       f"+profiling_results_dirpath={tmp_path / 'prof'}")
    assert "3 ok, 0 failed of 3" in printed
    assert "Profiling: nothing was profiled in this run (no verification here: the agents verify" in printed
    for server in (AGENT, "math_with_judge"):
        assert (f"Profiling: NeMo Gym server {server}: no profile (it does not profile itself (/stats answered "
                "HTTP 404") in printed, printed
    assert not list((tmp_path / "prof").glob("*.log"))


def test_profiling_enabled_writes_ng_runs_own_server_profiles(nemo_gym, tmp_path, capsys):
    """Seed 003 against ng_run +profiling_enabled=true: every server's own yappi profile of the run lands in
    DIR/<server>.log, the servers found through the head server, in the columns of ng_run's own log."""
    from workers.profiling.nemo_gym import parse_log

    if not shutil.which("dot"):
        pytest.skip("graphviz's dot is missing: ng_run's profiling (nemo_gym.profiling.Profiler) needs it")
    ng_dir = tmp_path / "ng-profiling"
    nemo_gym.configure({"NEMO_GYM_PROFILING_DIR": str(ng_dir)})  # the next test's nemo_gym restarts it plain
    inp = write_tasks(tmp_path / "tasks.jsonl", 4)
    logs = tmp_path / "profiling" / "baseline"
    printed = run_ours(nemo_gym, inp, tmp_path / "o" / "rollouts.jsonl", capsys, "+num_repeats=2",
                       "+profiling_enabled=true", f"+profiling_results_dirpath={logs}")
    assert "8 ok, 0 failed of 8" in printed, printed
    for server in ("math_with_judge", AGENT):
        path = logs / f"{server}.log"
        assert f"Profiling: {path}" in printed, printed
        ours = path.read_text()
        own = next(ng_dir.glob(f"*___{server}/{server}.log")).read_text()  # what ng_run's server wrote
        header = next(line for line in own.splitlines() if line.startswith("name"))
        assert header in ours.splitlines()  # the same columns, the same widths: `diff` lines up
        rows = parse_log(ours)
        assert rows and all(r.ncall >= 1 for r in rows)
    verify = [r for r in parse_log((logs / "math_with_judge.log").read_text()) if r.name.endswith(".verify")]
    assert verify and verify[0].ncall == 8, verify  # the run's 8 verifications, not the server's whole life
