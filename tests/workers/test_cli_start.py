"""The collection command's fast start (workers/cli_start.py, issue 28): which runs warm the verifier pool while
Django sets up, and that the pool it warms is the one the engine then uses without waiting."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
import pytest

from workers import cli_start
from workers.engine.verify_pool import SHARED_VERIFY_POOL, VerifyBatcher, VerifyPool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_only_runs_that_verify_in_the_pool_warm_it(monkeypatch):
    started = []
    monkeypatch.setattr(cli_start, "_warm", lambda *a: started.append(a))
    assert cli_start.prewarm_from_argv(["manage.py", "migrate"]) is None
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "--help"]) is None
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+verify_mode=deferred"]) is None
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+agent_name=a"]) is None  # agents verify
    for verifier in ("none", "judge", "code", "my_pkg.my_verifier"):  # on the loop, remote, a sandbox, a plug-in
        assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", f"+verifier={verifier}"]) is None
    # math's fast path (fast mode) needs no pool before the run
    assert cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+verify_mode=fast"]) is None
    for verifier in ("exact", "math"):
        t = cli_start.prewarm_from_argv(["manage.py", "collect_rollouts", "+input_jsonl_fpath=x",
                                         f"+verifier={verifier}"])
        t.join(5)
    assert started == [(SHARED_VERIFY_POOL, "exact", None), (SHARED_VERIFY_POOL, "math", None)]


WATCH_IMPORTS = """
import os, sys, threading
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        seen.append((threading.current_thread().name, name))
sys.meta_path.insert(0, Watch())
os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
os.environ["CONTROLPLANE_LEAN_CLI"] = "1"
from workers.cli_start import prewarm_from_argv
thread = prewarm_from_argv(["manage.py", "collect_rollouts", "+input_jsonl_fpath=x", "+verifier=math"])
import django
django.setup()
thread.join(60)
from workers.engine.verify_pool import SHARED_VERIFY_POOL
print("warm", getattr(SHARED_VERIFY_POOL.executor(None), "_engine_warm", False))
print("thread imports", [n for who, n in seen if who == thread.name])
SHARED_VERIFY_POOL.kill()
"""


def test_the_warming_thread_imports_nothing_while_django_sets_up(tmp_path):
    """The main thread imports what warming needs first: CPython 3.11's imports from two threads at once can fail
    (a command's settings import died once of "NameError: name 'sys' is not defined" in importlib while the
    thread imported the verifiers, aiohttp and importlib.metadata)."""
    env = {**os.environ, "PYTHONPATH": REPO, "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    out = subprocess.run([sys.executable, "-c", WATCH_IMPORTS], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warm True" in out.stdout and "thread imports []" in out.stdout, out.stdout


def test_an_engine_run_does_not_wait_for_a_pool_being_warmed():
    pool = VerifyPool()
    try:
        executor = pool.executor(1)
        executor._engine_warming = True  # what prewarm() sets while its warm-up runs
        loop = asyncio.new_event_loop()
        try:
            batcher = VerifyBatcher(loop, 1, pool=pool)
            stop = asyncio.Event()
            loop.run_until_complete(asyncio.wait_for(batcher.warm("math", stop, logging.getLogger("t")), 1.0))
        finally:
            loop.close()
        pool.prewarm("exact", 1)
        assert getattr(pool.executor(1), "_engine_warm", False)
    finally:
        pool.shutdown()


@pytest.mark.slow
def test_the_command_still_exits_with_its_status_and_message():
    p = subprocess.run([sys.executable, "manage.py", "collect_rollouts", "+no_such_key=1"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "no_such_key" in p.stderr


def test_engine_processes_split_the_cores_between_their_verifier_pools(monkeypatch):
    monkeypatch.setattr(cli_start, "_warm", lambda *a: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    argv = ["manage.py", "collect_rollouts", "+input_jsonl_fpath=x", "+engine_processes=3"]
    monkeypatch.delenv("VERIFY_POOL_PROCESSES", raising=False)
    cli_start.prewarm_from_argv(argv)
    assert os.environ["VERIFY_POOL_PROCESSES"] == "6"  # ceil(16 / 3) each, not 3 pools of 16
    monkeypatch.setenv("VERIFY_POOL_PROCESSES", "2")  # the operator's own figure is kept
    cli_start.prewarm_from_argv(argv)
    assert os.environ["VERIFY_POOL_PROCESSES"] == "2"
    monkeypatch.delenv("VERIFY_POOL_PROCESSES")
    for value in ("1", "two"):  # one process, or a bad value (the command says what is wrong): untouched
        cli_start.prewarm_from_argv(argv[:-1] + [f"+engine_processes={value}"])
        assert "VERIFY_POOL_PROCESSES" not in os.environ


KILL_AND_EXIT = """
import os, sys
from workers.engine.verify_pool import VerifyPool
pool = VerifyPool()
executor = pool.executor(1)
assert executor.submit(int, "7").result(timeout=60) == 7
names = [getattr(q, a)._semlock.name for q in (executor._call_queue, executor._result_queue)
         for a in ("_rlock", "_wlock", "_sem") if hasattr(q, a)]
print(" ".join(names), flush=True)
pool.kill()  # what the command's quick exit does, then no interpreter teardown
os._exit(0)
"""


@pytest.mark.slow
def test_a_quick_exit_leaves_no_semaphores_and_no_warning():
    """The command kills its verifier pool and leaves without teardown; the pool's named semaphores are removed
    first, so multiprocessing's resource tracker has nothing to warn about after the summary."""
    p = subprocess.run([sys.executable, "-c", KILL_AND_EXIT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    names = p.stdout.split()
    assert len(names) == 5  # the call queue's two locks and bound, the result queue's two locks
    assert "leaked semaphore" not in p.stderr
    left = [n for n in names if os.path.exists("/dev/shm/sem." + n.lstrip("/"))]
    assert not left


QUICK_EXIT_WITH_FORK_SERVER = """
import multiprocessing.forkserver, sys
from workers.engine import forkserver
forkserver.PRELOAD = [*forkserver.PRELOAD, "tests.workers.slow_teardown"]  # its teardown: 3 s, not 0.14-0.21
from workers.engine.verify_pool import SHARED_VERIFY_POOL
from workers.cli_start import quick_exit
# a pool process forked by the fork server: its preload (math-verify, sympy) is done
assert SHARED_VERIFY_POOL.executor(1).submit(int, "7").result(timeout=120) == 7
print(multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
quick_exit(0)
"""


@pytest.mark.slow
def test_the_commands_output_ends_when_it_exits():
    """Whoever reads the command's output (a pipe, $(...), subprocess.run) has its end when the command exits: the
    verifier pool's fork server, which holds the same stdout, is stopped with the pool. Left to leave by itself it
    went through an interpreter teardown of math-verify and sympy first: the output ended 0.14-0.21 s after the
    command had exited (here made 3 s, so that the test does not hang on the machine's speed)."""
    p = subprocess.Popen([sys.executable, "-c", QUICK_EXIT_WITH_FORK_SERVER], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    fork_server = int(p.stdout.readline())
    assert p.wait(120) == 0
    t0 = time.monotonic()
    assert p.stdout.read() == b""  # returns at the output's end: when no process holds it any more
    ended_s = time.monotonic() - t0
    p.stdout.close()
    assert ended_s < 1.5, ended_s
    with contextlib.suppress(FileNotFoundError):  # gone, or a zombie waiting for its new parent to reap it
        assert open(f"/proc/{fork_server}/stat").read().split(") ")[1][0] == "Z"
