"""The drop-in `collect_rollouts` CLI: arguments, end to end against the simulator (NeMo Gym-shaped
output beside the output path), resume after Ctrl-C and after SIGKILL without duplicates."""
from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.models import Count

from controlplane.jobs.dropin_args import ArgError, parse_overrides
from controlplane.jobs.models import CollectionJob, JobChunk, JobState, Rollout

REPO = Path(__file__).resolve().parents[2]


def write_math(path: Path, n: int, start: int = 0) -> Path:
    with open(path, "w") as f:
        for i in range(start, start + n):
            a, b = 3 * i + 1, 7 * i + 2
            f.write(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": f"What is {a} + {b}?"}]},
                                "question": f"What is {a} + {b}?", "expected_answer": str(a + b), "id": f"t{i}"}) + "\n")
    return path


# --- arguments (no database) --------------------------------------------------------------------
BASE = ["+input_jsonl_fpath=in.jsonl", "+output_jsonl_fpath=out.jsonl", "+model_base_url=http://h:1/v1", "+model_name=m"]


def test_parse_nested_and_json_values():
    cfg = parse_overrides(BASE + ["+limit=100", "+num_repeats=4", "+num_samples_in_parallel=32",
                                  "+responses_create_params.max_output_tokens=256",
                                  "+responses_create_params.temperature=0.7", "+responses_create_params.service_tier=flex",
                                  "+responses_create_params.metadata.run=a", "+agent_name=my_agent",
                                  "++verifier=exact", "verify_mode=deferred", "+policy_api_key=sk-1",
                                  "+verifier_options.normalize=true", "+input_jsonl_fpath=1.jsonl"])
    assert cfg["limit"] == 100 and cfg["num_repeats"] == 4 and cfg["num_samples_in_parallel"] == 32
    assert cfg["responses_create_params"] == {"max_output_tokens": 256, "temperature": 0.7, "service_tier": "flex",
                                              "metadata": {"run": "a"}}
    assert cfg["agent_name"] == "my_agent" and cfg["verifier"] == "exact" and cfg["verify_mode"] == "deferred"
    assert cfg["api_key"] == "sk-1" and cfg["verifier_options"] == {"normalize": True}
    assert cfg["input_jsonl_fpath"] == "1.jsonl"  # paths stay strings
    assert cfg["limit"] is not None and parse_overrides(BASE + ["+limit=null"])["limit"] is None


@pytest.mark.parametrize("text", ["none", "None", "null"])
def test_verifier_none_is_the_choice_not_null(text):
    """`none` is a listed verifier; the values parser reads it as null, which must still name that verifier."""
    assert parse_overrides(BASE + [f"+verifier={text}"])["verifier"] == "none"


@pytest.mark.parametrize("extra, fragment", [
    (["+limt=5"], "unknown key +limt (did you mean +limit?)"),
    (["+limit=abc"], "+limit must be an integer"),
    (["+num_repeats=0"], "+num_repeats must be >= 1"),
    (["+responses_create_params.temperature=hot"], "temperature must be a number"),
    (["+responses_create_params.max_output_tokens=-1"], "max_output_tokens must be a positive integer"),
    (["+verifier=magic"], "+verifier must be one of"),
    (["+request_timeout_s=soon"], "+request_timeout_s must be a number"),
    (["nokeyvalue"], "not of the form +key=value"),
])
def test_parse_errors(extra, fragment):
    with pytest.raises(ArgError, match=None) as ei:
        parse_overrides(BASE + extra)
    assert fragment in str(ei.value)


def test_missing_required():
    with pytest.raises(ArgError, match=r"missing required key\(s\): \+input_jsonl_fpath"):
        parse_overrides(["+output_jsonl_fpath=o.jsonl", "+model_base_url=http://h", "+model_name=m"])


@pytest.mark.slow
@pytest.mark.django_db
def test_command_error_lists_valid_keys_and_help(tmp_path):
    with pytest.raises(CommandError) as ei:
        call_command("collect_rollouts", "+bogus=1")
    msg = str(ei.value)
    assert "unknown key +bogus" in msg and "--help" in msg and "\n" not in msg  # one line; the keys are in --help
    with pytest.raises(CommandError, match="no such file"):
        call_command("collect_rollouts", f"+input_jsonl_fpath={tmp_path}/nope.jsonl",
                     f"+output_jsonl_fpath={tmp_path}/o.jsonl", "+model_base_url=http://127.0.0.1:9", "+model_name=m")
    help_text = subprocess.run([sys.executable, "manage.py", "collect_rollouts", "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=60, env=_env()).stdout
    for key in ("+input_jsonl_fpath", "+output_jsonl_fpath", "+limit", "+num_repeats", "+num_samples_in_parallel",
                "+responses_create_params.<param>", "+agent_name", "+model_base_url", "+model_name", "+api_flavor",
                "+api_key", "+request_timeout_s", "+max_retries", "+verifier", "+verify_mode"):
        assert key in help_text, key


@pytest.mark.django_db
def test_rejected_input_prints_bad_lines(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"responses_create_params": {"input": "ok"}}\n{oops\n')
    with pytest.raises(CommandError, match="rejected.*accept_partial"):
        call_command("collect_rollouts", f"+input_jsonl_fpath={p}", f"+output_jsonl_fpath={tmp_path}/o.jsonl",
                     "+model_base_url=http://127.0.0.1:9", "+model_name=m")
    assert "line 2: not valid JSON" in capsys.readouterr().err
    p.write_text('{oops\n["a list"]\n')  # no valid line at all: keeping the good ones would not help
    with pytest.raises(CommandError) as ei:
        call_command("collect_rollouts", f"+input_jsonl_fpath={p}", f"+output_jsonl_fpath={tmp_path}/o.jsonl",
                     "+model_base_url=http://127.0.0.1:9", "+model_name=m")
    assert str(ei.value) == f"+input_jsonl_fpath {p}: the file has no valid rows"
    err = capsys.readouterr().err
    assert "line 1: not valid JSON" in err and "line 2: a line must be a JSON object, got array" in err


# --- end to end ---------------------------------------------------------------------------------
def _database_url():
    s = connection.settings_dict
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    auth = s.get("USER") or "postgres"
    if s.get("PASSWORD"):
        auth += ":" + s["PASSWORD"]
    return f"postgres://{auth}@{host}:{port}/{s['NAME']}"


def _env(**extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if connection.vendor == "postgresql" and connection.settings_dict.get("NAME"):
        env["DATABASE_URL"] = _database_url()
    return env


def cli_args(inp, out, sim_url, *extra):
    return ["+agent_name=math_agent", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
            "+num_repeats=2", "+num_samples_in_parallel=8", "+responses_create_params.max_output_tokens=48",
            "+responses_create_params.temperature=0.5", f"+model_base_url={sim_url}/v1", "+model_name=sim-model",
            "+verifier=math", "+request_timeout_s=20", "+max_retries=2", *extra]


def check_output(out: Path, n_tasks: int, repeats: int):
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    pairs = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    # in the order they were stored, as NeMo Gym appends them; each pair once
    assert sorted(pairs) == [(t, k) for t in range(n_tasks) for k in range(repeats)], "one line per rollout"
    r = rows[0]
    assert {"responses_create_params", "question", "expected_answer", "response", "reward"} <= set(r)
    assert r["responses_create_params"]["max_output_tokens"] == 48 and r["responses_create_params"]["temperature"] == 0.5
    assert r["response"]["output"][0]["type"] == "message"
    assert r["response"]["usage"]["output_tokens"] > 0 and "input_tokens" in r["response"]["usage"]
    assert isinstance(r["reward"], float) and "extracted_answer" in r
    stem = out.with_suffix("")
    assert Path(f"{stem}_failures.jsonl").exists()
    metrics = json.loads(Path(f"{stem}_aggregate_metrics.json").read_text())
    assert "mean/reward" in metrics
    return rows, metrics


def assert_exactly_once(job, n):
    job.refresh_from_db()
    assert Rollout.objects.filter(job=job).count() == n
    assert not (Rollout.objects.filter(job=job).values("task_index", "rollout_index")
                .annotate(c=Count("id")).filter(c__gt=1).exists())


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_end_to_end_in_process_then_rerun_rewrites(simulator, tmp_path, capsys, monkeypatch):
    from controlplane.jobs import services

    read_back = services.compute_summaries
    calls = []
    monkeypatch.setattr(services, "compute_summaries", lambda job, **kw: calls.append(job.pk) or read_back(job, **kw))
    inp = write_math(tmp_path / "tasks.jsonl", 30)
    out = tmp_path / "out" / "rollouts.jsonl"
    call_command("collect_rollouts", *cli_args(inp, out, simulator.url))
    # the summaries were fed as the rows were stored: no second read of the table, the same figures
    job = CollectionJob.objects.get()
    assert calls == [] and (job.aggregate_metrics, job.timing_summary) == read_back(job)
    captured = capsys.readouterr()
    assert "Collecting rollouts" in captured.err and "it/s" in captured.err
    assert "60 ok, 0 failed of 60" in captured.out and "Mean reward:" in captured.out
    rows, metrics = check_output(out, 30, 2)
    assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(metrics["mean/reward"])
    job = CollectionJob.objects.get()
    # throughput as the API and History show it: stored rows and tokens over the running time
    from controlplane.jobs.figures import job_figures

    f = job_figures(job)
    assert f["output_tokens"] == sum(r["response"]["usage"]["output_tokens"] for r in rows) > 0
    assert (f"Throughput: {f['average_rollouts_per_s']:.2f} rollouts/s, {f['average_tokens_per_s']:.1f} tokens/s "
            f"({f['average_output_tokens_per_s']:.1f} output tokens/s)") in captured.out
    assert job.state == JobState.COMPLETED and job.idempotency_key.startswith("cli:")
    assert job.name == "cli: math_agent" and job.output_path == str(out.resolve())
    assert job.responses_create_params == {"max_output_tokens": 48, "temperature": 0.5}
    # +chunk_size unset, one process: the whole input is one chunk (no drain of the requests in flight between
    # chunks); the job's identity still names the default, so the same command finds this job again
    assert job.chunk_size == 30 and list(JobChunk.objects.filter(job=job).values_list("start_row", "end_row")) == \
        [(0, 30)]

    out.unlink()
    call_command("collect_rollouts", *cli_args(inp, out, simulator.url))  # same command: no new job, output again
    assert CollectionJob.objects.count() == 1 and "already completed" in capsys.readouterr().err
    check_output(out, 30, 2)
    # different args: a new job, appended after the lines already there (NeMo Gym's docs: `tail -n +N` of the
    # input into a new run with the same output path appends)
    before = out.read_text()
    call_command("collect_rollouts", *cli_args(inp, out, simulator.url, "+limit=10"))
    assert CollectionJob.objects.count() == 2 and "Output: appending to" in capsys.readouterr().err
    assert CollectionJob.objects.latest("pk").chunk_size == 10  # one chunk of the rows +limit leaves
    text = out.read_text()
    assert text.startswith(before) and len(text.splitlines()) == 60 + 20
    appended = [json.loads(line) for line in text[len(before):].splitlines()]
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in appended) == [(t, k) for t in range(10)
                                                                                     for k in range(2)]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_jobs_only_process_keeps_its_verification_cache_local(simulator, tmp_path, settings):
    """The drop-in's one engine process is the only one verifying its job: a shared lookup could find only what
    the run stored itself (its local cache holds that), so the cache never asks Redis (no probe of 256 round
    trips, no client made on the event loop) and nothing of the job is written there. VERIFY_CACHE_SHARED=always
    keeps it."""
    import redis

    from controlplane.jobs.models import JobMetricSample
    from controlplane.jobs.verify_cache import verify_cache_scope

    inp = write_math(tmp_path / "tasks.jsonl", 20)
    client = redis.Redis.from_url(settings.VERIFY_CACHE_URL)

    def run(*extra):
        call_command("collect_rollouts", *cli_args(inp, tmp_path / "out.jsonl", simulator.url, *extra))
        job = CollectionJob.objects.latest("pk")
        assert job.state == JobState.COMPLETED and job.rollouts.exists()
        last = JobMetricSample.objects.filter(job=job).latest("pk").extra
        return last, len(list(client.scan_iter(f"rcp:vcache:{verify_cache_scope(job)}:*")))

    last, keys = run()
    assert last["verify_cache_shared"] is False and keys == 0
    assert last["verify_cache_choice"].startswith("local: the only process verifying this job")
    assert last["verify_cache_lookups"] == 40
    settings.VERIFY_CACHE_SHARED = "always"
    last, keys = run("+limit=10")
    assert last["verify_cache_shared"] is True and keys >= 10 and "verify_cache_choice" not in last


@pytest.mark.slow
def test_a_run_never_imports_celery(simulator, tmp_path):
    """A drop-in run sends no task and is no worker: it never imports Celery (the apps' tasks modules and the
    worker's signals cost 0.2-0.4 s of every start before). Read from `python -X importtime`, which lists every
    module the command's processes imported."""
    inp = write_math(tmp_path / "tasks.jsonl", 20)
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True, timeout=300)
    p = subprocess.run([sys.executable, "-X", "importtime", "manage.py", "collect_rollouts",
                        *cli_args(inp, tmp_path / "out.jsonl", simulator.url)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "40 ok, 0 failed of 40" in p.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert {"django.db.models", "aiohttp", "math_verify"} <= imported  # the listing is complete enough to tell
    assert sorted(m for m in imported if m.split(".")[0] in ("celery", "kombu", "billiard")) == []


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_failed_job_exits_nonzero_with_message(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    inp = write_math(tmp_path / "t.jsonl", 3)
    with pytest.raises(CommandError) as ei:
        call_command("collect_rollouts", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={tmp_path}/o.jsonl",
                     f"+model_base_url=http://127.0.0.1:{port}", "+model_name=m", "+max_retries=1",
                     "+connect_timeout_s=1")
    job = CollectionJob.objects.get()
    job.refresh_from_db()
    if job.state == JobState.FAILED:
        assert ei.value.returncode == 1 and "failed" in str(ei.value) and job.error_message in str(ei.value)
    else:  # the runtime may record every row as a connection failure and complete instead
        pytest.fail(f"job ended {job.state} with {job.failed_count} failed rows; expected a failed job")
    assert (tmp_path / "o.jsonl").exists()


def _start_cli(args, log, **env):
    return subprocess.Popen([sys.executable, "manage.py", "collect_rollouts", *args], cwd=REPO, env=_env(**env),
                            stdout=log, stderr=subprocess.STDOUT)


def _wait_rows(job_filter, at_least, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = CollectionJob.objects.filter(**job_filter).first()
        if job and Rollout.objects.filter(job=job).count() >= at_least:
            return job
        if proc.poll() is not None:
            raise AssertionError(f"CLI exited early with {proc.returncode}")
        time.sleep(0.2)
    raise AssertionError("no progress")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_interrupt_then_rerun_resumes_exactly_once(simulator_factory, tmp_path, sig):
    n_tasks, repeats = 60, 2
    sim = simulator_factory(ttft_ms=40, itl_ms=2)
    inp = write_math(tmp_path / "tasks.jsonl", n_tasks)
    out = tmp_path / "rollouts.jsonl"
    # SIGKILL: one chunk, so the rerun has nothing to run until the dead run's lease on it expires
    chunk_size = n_tasks * repeats if sig == signal.SIGKILL else 20
    args = cli_args(inp, out, sim.url, "+num_samples_in_parallel=4", f"+chunk_size={chunk_size}")
    with open(tmp_path / "run1.log", "w") as log:
        p1 = _start_cli(args, log, JOBS_LEASE_TIMEOUT_S="2", JOBS_FLUSH_ROWS="4")
        try:
            job = _wait_rows({"name": "cli: math_agent"}, 12, p1)
            p1.send_signal(sig)
            rc = p1.wait(timeout=30)
        finally:
            if p1.poll() is None:
                p1.kill()
    log1 = (tmp_path / "run1.log").read_text()
    job.refresh_from_db()
    done_after_first = Rollout.objects.filter(job=job).count()
    assert 0 < done_after_first < n_tasks * repeats, log1
    # the output holds the rollouts stored when the run stopped, each once: appended as each batch committed. A
    # SIGKILL can land between a batch's commit and its write (outfiles: the rerun appends what the file lacks), so
    # there the file may lag the table by that batch, never hold a row the table lacks
    lines = out.read_text().splitlines()
    stored = set(Rollout.objects.filter(job=job, status=Rollout.Status.OK).values_list("task_index", "rollout_index"))
    on_disk = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in map(json.loads, lines)]
    assert len(on_disk) == len(set(on_disk)), len(on_disk)
    if sig == signal.SIGINT:
        assert set(on_disk) == stored, (len(on_disk), len(stored))
    else:
        assert set(on_disk) <= stored, (len(on_disk), len(stored))
    # written before collecting, as ng_collect_rollouts does: its own +resume_from_cache=true needs it on this
    # interrupted run's files (it skips the cache, and clears the output, where it is missing)
    mat = [json.loads(line) for line in (tmp_path / "rollouts_materialized_inputs.jsonl").read_text().splitlines()]
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in mat) == \
        [(t, r) for t in range(n_tasks) for r in range(repeats)]
    if sig == signal.SIGINT:
        assert rc == 130, log1
        assert "Rerun the same command to resume" in log1
        assert job.state == JobState.PAUSED
    else:
        assert rc == -signal.SIGKILL
        assert job.state == JobState.RUNNING  # left behind by the dead process; its lease expires

    with open(tmp_path / "run2.log", "w") as log:
        # SIGKILL: the rerun judges the dead run's heartbeat stale after 20 s, longer than its own start-up (even on a
        # machine loaded by the whole suite, where 10 s was once not), so it surely waits for that lease
        p2 = _start_cli(args, log, JOBS_LEASE_TIMEOUT_S="20" if sig == signal.SIGKILL else "2")
        rc2 = p2.wait(timeout=240)
    log2 = (tmp_path / "run2.log").read_text()
    assert rc2 == 0, log2
    assert f"Job {job.pk}: resuming" in log2
    if sig == signal.SIGKILL:  # the dead run's lease had to expire first: not counted as collection time
        assert "for a previous run's lease to expire" in log2, log2
    else:  # paused by Ctrl-C: its chunks were released, nothing to wait for
        assert "lease to expire" not in log2, log2
    assert CollectionJob.objects.count() == 1
    assert_exactly_once(job, n_tasks * repeats)
    assert job.state == JobState.COMPLETED
    rows, _ = check_output(out, n_tasks, repeats)  # the rerun appended only what was new: no line twice
    assert out.read_text().splitlines()[:len(lines)] == lines
    print(f"\n{sig.name}: {done_after_first} rows stored before the interrupt; rerun completed {len(rows)}")


def _fresh_checkout_env(var_dir, **extra):
    """The environment of a fresh checkout: no DATABASE_URL (the embedded SQLite file under var/)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "TEST_DATABASE_URL")}
    return {**env, "CONTROLPLANE_VAR_DIR": str(var_dir), **extra}


@pytest.mark.slow
def test_fresh_checkout_migrates_the_embedded_database_and_finds_the_served_model(simulator, tmp_path):
    inp = write_math(tmp_path / "tasks.jsonl", 6)
    out = tmp_path / "out" / "rollouts.jsonl"
    var = tmp_path / "var"
    cmd = [sys.executable, "manage.py", "collect_rollouts", f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
           f"+model_base_url={simulator.url}", "+responses_create_params.max_output_tokens=24"]
    proc = subprocess.run(cmd, cwd=REPO, env=_fresh_checkout_env(var), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Setting up the embedded database" in proc.stderr and (var / "controlplane.sqlite3").exists()
    assert f"Model: {simulator.model} (the one model" in proc.stderr
    # the summary (stdout) names no wait: no one held this new job's chunks
    assert "This run: 6 rollouts" in proc.stdout and "lease to expire" not in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all("reward" in r for r in rows)
    # a database that is not the embedded one is never migrated behind the user's back
    elsewhere = tmp_path / "elsewhere.sqlite3"
    proc = subprocess.run(cmd, cwd=REPO, env=_fresh_checkout_env(var, DATABASE_URL=f"sqlite:///{elsewhere}"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "run `python manage.py migrate` first" in proc.stderr


@pytest.mark.django_db
def test_a_server_that_is_down_is_named_not_the_model_name(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"responses_create_params": {"input": "What is 1 + 1?"}}\n')
    with pytest.raises(CommandError) as ei:
        call_command("collect_rollouts", f"+input_jsonl_fpath={p}", f"+output_jsonl_fpath={tmp_path}/o.jsonl",
                     "+model_base_url=http://127.0.0.1:9")  # nothing listens; no +model_name
    msg = str(ei.value)
    assert msg.startswith("cannot reach the model server at http://127.0.0.1:9") and "+model_base_url" in msg
    assert "give +model_name" not in msg


# --- +profiling_enabled: NeMo Gym's <server>.log ------------------------------------------------------------
HEADER_TITLES = ("name", "ncall", "tsub", "ttot", "tavg")


def check_log_columns(text: str) -> list[str]:
    """NeMo Gym's <server>.log, line for line: yappi's preamble, the header, then rows whose columns start where the
    header's titles do (name 200 wide, ncall 10, the times 8, two spaces between). Returns the rows."""
    lines = text.split("\n")
    assert lines[:4] == ["", "Clock type: CPU", "Ordered by: totaltime, desc", ""], lines[:4]
    header = lines[4]
    starts = [header.index(t) for t in HEADER_TITLES]
    assert starts == [0, 202, 214, 224, 234], starts
    rows = [line for line in lines[5:] if line]
    for line in rows:
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        assert cells[0] and ":" in cells[0], line
        assert line[starts[1] - 2:starts[1]] == "  " and cells[1].split("/")[0].isdigit(), line
        for cell in cells[2:]:
            float(cell)
    return rows


def test_format_log_is_yappis_own_table(tmp_path):
    """The same functions through yappi's print_all (what NeMo Gym's Profiler.dump writes) and format_log give the
    same lines."""
    import io

    import yappi

    from workers.profiling.nemo_gym import LOG_COLUMNS, format_log, parse_log

    def leaf(n):
        return sum(i * i for i in range(n))

    def work():
        return [leaf(2000) for _ in range(30)]

    yappi.clear_stats()
    yappi.set_clock_type("cpu")
    yappi.start(profile_threads=False)  # this thread only: another thread's counts (xdist's execnet) keep moving
    try:
        work()
    finally:
        yappi.stop()
    buf = io.StringIO()
    yappi.get_func_stats().print_all(out=buf, columns=LOG_COLUMNS)
    yappi.clear_stats()
    theirs = buf.getvalue()
    ours = format_log(parse_log(theirs), clock="cpu")
    check_log_columns(ours)
    def split(text):  # (header lines in order, function rows as a multiset): rows tied in total time may swap,
        lines = text.split("\n")  # anywhere in the table (the first rows, whose times are the whole run's, too)
        rows = [ln for ln in lines if re.match(r"^\S+:\d+ ", ln)]
        return [ln for ln in lines if ln not in rows], sorted(rows)

    assert split(ours) == split(theirs)


def test_format_log_keeps_each_rows_printed_mean():
    """A row whose printed mean is not its printed total over its calls (yappi divides the unrounded total: 30 calls
    of 0.062355 s in all print 0.002078 each, not 0.062355 / 30 = 0.002079) is written back as yappi wrote it."""
    from workers.profiling.nemo_gym import format_log, parse_log

    table = format_log(parse_log("name  ncall  tsub  ttot  tavg\nx.py:1 f  30  0.000073  0.062355  0.002078\n"))
    row = check_log_columns(table)[0]
    assert row.split()[-3:] == ["0.000073", "0.062355", "0.002078"], row


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_profiling_enabled_writes_nemo_gym_logs_the_seed_can_diff(simulator, tmp_path, capsys):
    from controlplane.profiling.models import ProfileSession

    inp = write_math(tmp_path / "tasks.jsonl", 20)
    logs = tmp_path / "profiling" / "baseline"
    call_command("collect_rollouts", *cli_args(inp, tmp_path / "out" / "rollouts.jsonl", simulator.url,
                                               "+profiling_enabled=true", f"+profiling_results_dirpath={logs}"))
    err = capsys.readouterr().err
    path = logs / "verifier_math.log"
    assert f"Profiling: {path}" in err, err
    rows = check_log_columns(path.read_text())
    assert any("workers/verifiers" in r for r in rows), rows[:5]
    job = CollectionJob.objects.get()
    assert ProfileSession.objects.filter(job=job, stopped_at__isnull=False).count() == 1  # for the run's duration
    # the seed's workflow: a second profiled run, then `diff` of the two logs lines up column for column
    after = tmp_path / "profiling" / "optimized"
    call_command("collect_rollouts", *cli_args(inp, tmp_path / "out2" / "rollouts.jsonl", simulator.url,
                                               "+profiling_enabled=true", f"+profiling_results_dirpath={after}"))
    check_log_columns((after / "verifier_math.log").read_text())
    diff = subprocess.run(["diff", str(path), str(after / "verifier_math.log")], capture_output=True, text=True)
    assert diff.returncode in (0, 1) and "Clock type" not in diff.stdout  # only rows differ
    # without a directory it says what is missing
    with pytest.raises(CommandError, match="needs \\+profiling_results_dirpath"):
        call_command("collect_rollouts", *cli_args(inp, tmp_path / "o3.jsonl", simulator.url, "+profiling_enabled=true"))
