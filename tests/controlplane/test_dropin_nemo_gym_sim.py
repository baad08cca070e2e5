"""collect_rollouts against a NeMo-Gym-shaped deployment (no ng_run needed): a head server answering
/global_config_dict_yaml, an agent answering POST /run and /aggregate_metrics, a resources server, each with
/stats as ng_run's `+profiling_enabled=true` servers have it (nemo_gym.server_utils.setup_profiling: /stats
writes `<working dir>/<profiling_results_dirpath>/<Class>___<name>/<name>.log` - the table's header only in
0.4.0 - and `<name>.callgrind`, and answers an empty body). Checks, against nemo-gym 0.4.0's rollout_collection.py:

- `+disable_aggregation=true` never calls the agents' /aggregate_metrics and writes no metrics file;
- the failures file holds one line per failed rollout of the run (NeMo Gym dispatches each rollout once per run
  and writes its result once), the engine's retries of a request notwithstanding;
- `+profiling_enabled=true +profiling_results_dirpath=DIR` writes each server's own profile of the run to
  `DIR/<server>.log`, discovered from the head server's config, and the job's profile shows it.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from django.core.management import call_command

from controlplane.jobs.models import CollectionJob, Rollout
from workers.profiling.nemo_gym import format_log, parse_log

pytestmark = pytest.mark.django_db(transaction=True)

AGENT, RES = "math_agent", "math_res"
PROFILE_DIR = "results/profiling/run"  # relative, as in seed 003: under each server's working directory


class FakeNemoGym:
    """Head, agent and resources servers on three ports, in a thread. `fail_tasks`: /run answers 500 for them;
    `marks`: fields added to a task's answer (an agent's `_ng_failure_class`, `_ng_no_persist`, ...)."""

    def __init__(self, root: Path, *, profiling=True, fail_tasks=()):
        self.root, self.profiling, self.fail_tasks = root, profiling, set(fail_tasks)
        self.marks: dict[int, dict] = {}  # task index -> fields added to its /run answer (`_ng_*` sentinels)
        self.calls = {"run": 0, "aggregate_metrics": 0, "stats": {AGENT: 0, RES: 0}}
        self.ports: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self.runners = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    # server working directories as ng_run sets them: <root>/<server type>/<impl>
    def workdir(self, name):
        return self.root / ("responses_api_agents/simple_agent" if name == AGENT else
                            "resources_servers/math_with_judge")

    def config(self):
        cfg = {"policy_api_key": "secret", "profiling_enabled": self.profiling,
               "config_paths": [str(self.root / "resources_servers/math_with_judge/configs/math_with_judge.yaml"),
                                str(self.root / "responses_api_agents/simple_agent/configs/simple_agent.yaml")],
               AGENT: {"responses_api_agents": {"simple_agent": {
                   "host": "127.0.0.1", "port": self.ports["agent"],
                   "resources_server": {"type": "resources_servers", "name": RES}}}},
               RES: {"resources_servers": {"math_with_judge": {"host": "127.0.0.1", "port": self.ports["res"]}}}}
        if self.profiling:
            cfg["profiling_results_dirpath"] = PROFILE_DIR
        return cfg

    def dump(self, name):
        """What nemo-gym 0.4.0's Profiler.dump writes: `<name>.log` with the table's header only (its row filter
        keeps nothing unless a required_str is set) and the cumulative profile since start-up in yappi's
        `<name>.callgrind`."""
        n = self.calls["run"]
        cls = "SimpleAgent" if name == AGENT else "MathWithJudgeResourcesServer"
        folder = self.workdir(name) / PROFILE_DIR / f"{cls}___{name}"
        folder.mkdir(parents=True, exist_ok=True)
        header = format_log([]).rstrip("\n") + "\n"
        (folder / f"{name}.log").write_text(header)
        app = str(self.workdir(name) / "app.py")
        fn = f"{cls}.{'run' if name == AGENT else 'verify'}"
        us = lambda s: int(s * 1e6)  # noqa: E731
        (folder / f"{name}.callgrind").write_text("\n".join([
            "version: 1", "creator: yappi", "pid: 1", "cmd:  app.py", "part: 1", "", "events: Ticks",
            f"fl=(1) {app}", f"fl=(2) {app}", f"fl=(3) {app}", f"fl=(4) {app}",
            f"fn=(1) handle {app}:10", f"fn=(2) {fn} {app}:118", f"fn=(3) _verify_answer {app}:145",
            f"fn=(4) startup {app}:30",  # before the run: not in the run's own log
            "", "fl=(1)", "fn=(1)", "10 100", "cfl=(2)", "cfn=(2)", f"calls={n} 0", f"0 {us(0.01 * n)}",
            "", "fl=(2)", "fn=(2)", f"118 {us(0.006 * n)}", "cfl=(3)", "cfn=(3)", f"calls={2 * n} 0",
            f"0 {us(0.004 * n)}",
            "", "fl=(3)", "fn=(3)", f"145 {us(0.004 * n)}",
            "", "fl=(4)", "fn=(4)", "30 500000"]) + "\n")

    def app(self, name):
        app = web.Application()

        async def stats(_request):
            if not self.profiling:
                raise web.HTTPNotFound()
            self.calls["stats"][name] += 1
            self.dump(name)
            return web.Response()

        app.router.add_get("/stats", stats)
        if name == AGENT:
            async def config(_request):
                return web.json_response(yaml.safe_dump(self.config()))

            async def run(request):
                body = await request.json()
                self.calls["run"] += 1
                if body.get("_ng_task_index") in self.fail_tasks:
                    return web.json_response({"detail": "boom"}, status=500)
                return web.json_response({"responses_create_params": body["responses_create_params"], "reward": 1.0,
                                          "response": {"usage": {"input_tokens": 5, "output_tokens": 3}},
                                          **self.marks.get(body.get("_ng_task_index"), {})})

            async def aggregate(request):
                body = await request.json()
                self.calls["aggregate_metrics"] += 1
                n = len(body["verify_responses"])
                return web.json_response({"agent_metrics": {"n": n}, "key_metrics": {"mean/reward": 1.0},
                                          "group_level_metrics": []})

            app.router.add_get("/global_config_dict_yaml", config)
            app.router.add_post("/run", run)
            app.router.add_post("/aggregate_metrics", aggregate)
        return app

    async def _start(self):
        for key, name in (("agent", AGENT), ("res", RES)):
            runner = web.AppRunner(self.app(name))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.ports[key] = site._server.sockets[0].getsockname()[1]
            self.runners.append(runner)

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc):
        async def stop():
            for r in self.runners:
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def head_args(self):  # the agent's app serves the head's /global_config_dict_yaml too
        return ["+head_server.host=127.0.0.1", f"+head_server.port={self.ports['agent']}"]


def tasks(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": f"{i} + 1?"}]},
                                "expected_answer": str(i + 1)}) + "\n")
    return path


def run_cli(ng, tmp_path, out, *extra, n=6):
    call_command("collect_rollouts", f"+agent_name={AGENT}", *ng.head_args,
                 f"+input_jsonl_fpath={tasks(tmp_path / 'tasks.jsonl', n)}", f"+output_jsonl_fpath={out}",
                 "+num_repeats=2", "+request_timeout_s=10", *extra)


def test_disable_aggregation_calls_no_aggregate_metrics(tmp_path, capsys):
    with FakeNemoGym(tmp_path / "ng") as ng:
        run_cli(ng, tmp_path, tmp_path / "a" / "rollouts.jsonl")
        assert ng.calls["aggregate_metrics"] == 1  # NeMo Gym's default: one call per agent
        assert (tmp_path / "a" / "rollouts_aggregate_metrics.json").exists()
        run_cli(ng, tmp_path, tmp_path / "b" / "rollouts.jsonl", "+disable_aggregation=true")
        assert ng.calls["aggregate_metrics"] == 1, "disable_aggregation still called /aggregate_metrics"
    err = capsys.readouterr().err
    assert "Skipping aggregate-metrics computation because disable_aggregation=True" in err
    assert not (tmp_path / "b" / "rollouts_aggregate_metrics.json").exists()
    assert len((tmp_path / "b" / "rollouts.jsonl").read_text().splitlines()) == 12
    job = CollectionJob.objects.get(output_path=str((tmp_path / "b" / "rollouts.jsonl").resolve()))
    assert "nemo_gym_agents" not in (job.aggregate_metrics or {})


@pytest.mark.slow
def test_failures_file_one_line_per_failed_rollout_despite_retries(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    with FakeNemoGym(tmp_path / "ng", fail_tasks={1, 4}) as ng:
        run_cli(ng, tmp_path, out, "+max_retries=2")
        runs = ng.calls["run"]
    failures = [json.loads(line) for line in (tmp_path / "rollouts_failures.jsonl").read_text().splitlines()]
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in failures]
    assert sorted(keys) == [(1, 0), (1, 1), (4, 0), (4, 1)], keys  # one line per failed rollout, never per attempt
    assert runs > 4 + 8, f"the engine retried the failing requests ({runs} /run calls) yet wrote one line each"
    ok = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(ok) == 8 and not {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in ok} & set(keys)
    assert all(r.get("failure_class") and "error" in r for r in failures)
    assert Rollout.objects.filter(status=Rollout.Status.FAILED).count() == 4


def check_columns(text: str) -> list[str]:
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name"))
    assert lines[header].split() == ["name", "ncall", "tsub", "ttot", "tavg"]
    return [line for line in lines[header + 1:] if line.strip()]


@pytest.mark.slow
def test_profiling_writes_each_servers_own_log_discovered_from_the_head(tmp_path, capsys):
    from django.contrib.auth.models import User
    from django.test import Client

    owner = User.objects.create_user("prof-owner", password="x")
    logs = tmp_path / "profiling" / "baseline"
    with FakeNemoGym(tmp_path / "ng") as ng:
        run_cli(ng, tmp_path, tmp_path / "out" / "rollouts.jsonl", "+profiling_enabled=true",
                f"+profiling_results_dirpath={logs}", "+owner=prof-owner")
        assert ng.calls["stats"] == {AGENT: 2, RES: 2}  # as the run starts and as it ends
        err = capsys.readouterr().err
        for name in (AGENT, RES):
            path = logs / f"{name}.log"
            assert f"Profiling: {path}" in err, err
            rows = parse_log(path.read_text())
            by_name = {r.name: r for r in rows}
            # the run's own share: 12 /run calls since the first pull, nothing from before it
            assert by_name["_verify_answer"].ncall == 24 and "startup" not in by_name, rows
            check_columns(path.read_text())
        # the job's profile (page, API, rolloutctl) shows each server's rows
        from controlplane.profiling.services import job_profile

        job = CollectionJob.objects.get()
        prof = job_profile(job)
        assert {f"nemo-gym:{AGENT}", f"nemo-gym:{RES}"} <= set(prof["workers"])
        assert any(r["name"] == "_verify_answer" for r in prof["rows"])
        servers = {srv["name"]: srv for srv in prof["servers"]}
        assert set(servers) == {AGENT, RES}
        assert {r["name"]: r["ncall"] for r in servers[RES]["rows"]}["_verify_answer"] == 24
        # the job page shows each server's table; rolloutctl profile prints it
        c = Client()
        c.force_login(owner)
        html = c.get(f"/jobs/{job.pk}/").content.decode()
        assert f'data-server="{RES}"' in html and f"NeMo Gym server {AGENT}" in html
        from types import SimpleNamespace

        from rolloutctl.cli import do_profile

        class FakeApi:
            def get_json(self, _path):
                return json.loads(json.dumps(prof))

        capsys.readouterr()
        do_profile(FakeApi(), SimpleNamespace(job=job.pk, off=False, show=True, top=10))
        printed = capsys.readouterr().out
        assert f"NeMo Gym server {RES} (3 functions" not in printed  # the run's share: startup is not in it
        assert f"NeMo Gym server {RES} (2 functions" in printed and "_verify_answer" in printed, printed
        # the same command again: the job is complete, nothing runs, no server is asked; its logs are written again
        again = tmp_path / "profiling" / "again"
        run_cli(ng, tmp_path, tmp_path / "out" / "rollouts.jsonl", "+profiling_enabled=true",
                f"+profiling_results_dirpath={again}", "+owner=prof-owner")
        assert ng.calls["stats"] == {AGENT: 2, RES: 2}
        assert (again / f"{RES}.log").read_text() == (logs / f"{RES}.log").read_text()
        # the seed's diff: a second profiled run; the two logs line up column for column
        after = tmp_path / "profiling" / "optimized"
        run_cli(ng, tmp_path, tmp_path / "out2" / "rollouts.jsonl", "+profiling_enabled=true",
                f"+profiling_results_dirpath={after}")
    diff = subprocess.run(["diff", str(logs / f"{RES}.log"), str(after / f"{RES}.log")], capture_output=True,
                          text=True)
    assert diff.returncode in (0, 1) and "Clock type" not in diff.stdout


def test_profiling_says_which_servers_do_not_profile_themselves(tmp_path, capsys):
    with FakeNemoGym(tmp_path / "ng", profiling=False) as ng:
        run_cli(ng, tmp_path, tmp_path / "rollouts.jsonl", "+profiling_enabled=true",
                f"+profiling_results_dirpath={tmp_path / 'prof'}")
    err = capsys.readouterr().err
    assert f"NeMo Gym server {RES}: no profile (it does not profile itself (/stats answered HTTP 404" in err, err
    assert not list((tmp_path / "prof").glob("*.log"))


@pytest.mark.slow
def test_resume_from_cache_keeps_nemo_gyms_failure_ledger(tmp_path):
    """nemo-gym 0.4.0: `<out>_failures.jsonl` is opened for append and never rewritten; each run writes one line
    per rollout that failed in it, and +resume_from_cache retries a failed rollout until it has
    NEMO_GYM_MAX_ROLLOUT_ATTEMPTS (3) lines there. The earlier lines stay; successes go to `<out>.jsonl`."""
    out = tmp_path / "rollouts.jsonl"
    fails = tmp_path / "rollouts_failures.jsonl"

    def keys(path):
        return sorted((r["_ng_task_index"], r["_ng_rollout_index"])
                      for r in map(json.loads, path.read_text().splitlines()))

    with FakeNemoGym(tmp_path / "ng", fail_tasks={1}) as ng:
        run_cli(ng, tmp_path, out)
        assert keys(fails) == [(1, 0), (1, 1)] and len(keys(out)) == 10
        first = fails.read_text()
        for attempt in (2, 3):  # a fresh run resuming from the files each time, as the same ng command would
            runs = ng.calls["run"]
            run_cli(ng, tmp_path, out, "+resume_from_cache=true", "+resume=false")
            assert ng.calls["run"] - runs >= 2  # only the failed rollouts are sent again (and retried by the engine)
            assert keys(fails) == [(1, 0)] * attempt + [(1, 1)] * attempt, "one line per failed rollout per run"
            assert fails.read_text().startswith(first) and len(keys(out)) == 10  # appended, nothing rewritten
        runs = ng.calls["run"]
        run_cli(ng, tmp_path, out, "+resume_from_cache=true", "+resume=false")
        assert ng.calls["run"] == runs, "3 attempts: NeMo Gym's resume does not send them again"
        assert len(keys(fails)) == 6
        job = CollectionJob.objects.order_by("-pk").first()
        assert job.failed_count == 2 and job.completed_count == 10
        # the rollouts succeed in a run below the cap: they join the output, the ledger keeps its lines
        ng.fail_tasks.clear()
    with FakeNemoGym(tmp_path / "ng2") as ng2:
        out2 = tmp_path / "b" / "rollouts.jsonl"
        out2.parent.mkdir()
        lines = out.read_text().splitlines()
        out2.write_text("\n".join(lines) + "\n")
        ledger = [line for line in fails.read_text().splitlines()][:2]  # one attempt each
        (tmp_path / "b" / "rollouts_failures.jsonl").write_text("\n".join(ledger) + "\n")
        run_cli(ng2, tmp_path, out2, "+resume_from_cache=true")
        assert ng2.calls["run"] == 2
        assert keys(out2) == [(t, k) for t in range(6) for k in range(2)]
        assert (tmp_path / "b" / "rollouts_failures.jsonl").read_text().splitlines() == ledger
