"""A hostile user's program in the code verifier: real processes, real Redis and PostgreSQL on 127.0.0.1.

- In the namespace sandbox it reads nothing of the worker (no /proc, no environment, no database file),
  reaches nothing (Redis, PostgreSQL), fills at most VERIFIER_SANDBOX_TMPFS_MB per writable place (the
  issue wrote 1.6 GB into shared memory), and can neither create a user namespace nor ptrace.
- Where namespaces are refused (a process under a seccomp filter like Docker's default profile), the code
  verifier refuses to run the program unless the operator opts into rlimits, and then the results and the
  job page say so.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from workers.verifiers import sandbox

REPO = Path(__file__).resolve().parents[2]
ROW = {"verifier_metadata": {"unit_tests": {"inputs": [""], "outputs": ["x"]}}}
needs_namespaces = pytest.mark.skipif(sandbox.mode()[0] != "bubblewrap",
                                      reason=f"no namespace sandbox here: {sandbox.mode()[1]}")

HOSTILE = textwrap.dedent('''
    import ctypes, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}

    def attempt(name, fn):
        try:
            out[name] = ["ok", repr(fn())[:300]]
        except BaseException as exc:
            out[name] = ["refused", type(exc).__name__ + ": " + str(exc)[:200]]

    def read(path):
        with open(path, "rb") as f:
            return f.read(4096)

    def fill(directory, mb):
        written = 0
        for i in range(mb * 2):  # 512 kB files: under the per-file limit, so only the tmpfs size stops them
            try:
                with open(os.path.join(directory, f"fill{i}"), "wb") as f:
                    f.write(b"x" * (1 << 19))
                written += 1 << 19
            except OSError as exc:
                return [written, type(exc).__name__ + ": " + str(exc)]
        return [written, "no error"]

    def check(rc):
        if rc != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return rc

    attempt("proc_1_environ", lambda: read("/proc/1/environ"))
    attempt("proc_self_environ", lambda: read("/proc/self/environ"))
    attempt("proc_listing", lambda: os.listdir("/proc"))
    attempt("database_file", lambda: read(DB_FILE))
    attempt("redis", lambda: socket.create_connection(("127.0.0.1", 6379), timeout=2).sendall(b"PING\\r\\n"))
    attempt("postgres", lambda: socket.create_connection(("127.0.0.1", 5432), timeout=2))
    out["env"] = dict(os.environ)
    for place in ("/dev/shm", "/tmp", "."):
        out["fill " + place] = fill(place, 48)
    attempt("unshare_user", lambda: check(libc.unshare(0x10000000)))
    pid = os.fork()
    if pid == 0:
        import time
        time.sleep(30)
        os._exit(0)
    attempt("ptrace_attach", lambda: check(libc.ptrace(16, pid, 0, 0)))  # PTRACE_ATTACH to its own child
    os.kill(pid, 9)
    print(json.dumps(out))
''')


def _secret_db(tmp_var: Path) -> Path:
    """A real SQLite database file holding a secret, where the embedded database lives (var/)."""
    path = tmp_var / "secsandbox-canary.sqlite3"
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    con.execute("create table keys (k text)")
    con.execute("insert into keys values ('sk-ALICE-API-KEY')")
    con.commit()
    con.close()
    return path


@pytest.mark.slow
@needs_namespaces
def test_hostile_program_reads_and_reaches_nothing_and_fills_no_memory(monkeypatch, settings):
    monkeypatch.setenv("WORKER_SECRET_FOR_TEST", "s3cret-DJANGO-KEY")
    db = _secret_db(Path(settings.VAR_DIR))
    try:
        res = sandbox.run_python(f"DB_FILE = {str(db)!r}\n" + HOSTILE,
                                 limits=sandbox.Limits(cpu_s=10, wall_s=30, memory_mb=256))
    finally:
        db.unlink(missing_ok=True)
    assert res.status == "ok", (res.status, res.stderr[-2000:])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # nothing of the worker: no /proc at all, an environment of a few harmless variables, no database file
    for name in ("proc_1_environ", "proc_self_environ", "proc_listing", "database_file"):
        assert out[name][0] == "refused", (name, out[name])
    assert set(out["env"]) <= {"PATH", "HOME", "LANG", "PWD", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED"}, out["env"]
    assert "s3cret" not in res.stdout and "sk-ALICE" not in res.stdout
    # nothing on the worker's loopback: Redis and PostgreSQL answer there, not in the sandbox's network
    assert out["redis"][0] == "refused" and out["postgres"][0] == "refused", (out["redis"], out["postgres"])
    # every writable place is a small tmpfs: 48 MB asked, at most VERIFIER_SANDBOX_TMPFS_MB (16) each landed
    cap = sandbox.tmpfs_mb() << 20
    for place in ("/dev/shm", "/tmp", "."):
        written, error = out["fill " + place]
        assert written <= cap and "No space left on device" in error, (place, written, error)
    # no nested user namespace, no ptrace
    assert out["unshare_user"][0] == "refused", out["unshare_user"]
    assert out["ptrace_attach"][0] == "refused" and "Operation not permitted" in out["ptrace_attach"][1]


# A process where the kernel refuses namespaces, as under Docker's default seccomp profile: unshare() and
# clone() with namespace flags fail with EPERM for it and its children (bubblewrap included).
NO_NAMESPACES = textwrap.dedent('''
    import errno, json, os, sys
    import pyseccomp as sc
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.EPERM), "unshare")
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000):
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.load()
    sys.path.insert(0, REPO)
    from workers.verifiers import sandbox, verify_row
    program = "open(%r, 'w').write('ran')\\nprint('x')" % MARKER
    text = "```python\\n" + program + "\\n```"
    try:
        res = verify_row("code", {"verifier_metadata": {"unit_tests": {"inputs": [""], "outputs": ["x"]}}}, text,
                         {"cpu_s": 2, "wall_s": 10})
        print(json.dumps({"mode": sandbox.mode(), "reward": res.reward, "fields": res.fields}))
    except Exception as exc:
        print(json.dumps({"mode": sandbox.mode(), "raised": type(exc).__name__, "error": str(exc)}))
''')


def _verify_without_namespaces(**env):
    shared = Path(tempfile.mkdtemp(prefix="secsandbox-"))
    shared.chmod(0o777)  # writable by the throwaway uid a root worker runs programs under
    marker = shared / "marker"
    script = f"REPO = {str(REPO)!r}\nMARKER = {str(marker)!r}\n" + NO_NAMESPACES
    full_env = {k: v for k, v in os.environ.items() if k != "VERIFIER_SANDBOX"}
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**full_env, **env}, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1]), marker.exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_without_namespaces_the_code_verifier_refuses_unless_the_operator_opts_in():
    out, ran = _verify_without_namespaces()
    assert out["mode"][0] == "unavailable" and "namespace" in out["mode"][1], out
    assert out.get("raised") == "SandboxUnavailable", out
    assert "VERIFIER_SANDBOX=rlimits" in out["error"] and "not run" in out["error"]
    assert not ran  # the program never ran
    # the operator's explicit opt-in: the weaker sandbox runs it, and every result says so
    out, ran = _verify_without_namespaces(VERIFIER_SANDBOX="rlimits")
    assert out["mode"][0] == "rlimits" and ran, out
    assert out["fields"]["sandbox"].startswith("rlimits only (VERIFIER_SANDBOX=rlimits"), out


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_job_page_says_when_programs_ran_without_namespaces(monkeypatch, simulator, mallory):
    from django.test import Client

    from controlplane.jobs import runtime, services
    from controlplane.jobs.models import Rollout
    from tests.factories import make_dataset, make_endpoint

    rows = [{"responses_create_params": {"input": f"print {i}"},
             "verifier_metadata": {"unit_tests": {"inputs": [""], "outputs": [str(i)]}}} for i in range(3)]
    ds = make_dataset(mallory, rows=rows)
    ep = make_endpoint(mallory, simulator.url, max_retries=1)
    web = Client()
    web.force_login(mallory)

    def run_job(choice):
        monkeypatch.setenv("VERIFIER_SANDBOX", choice)
        job = services.create_job(owner=mallory, dataset=ds, endpoint=ep, verifier="code", launch=False,
                                  num_samples_in_parallel=3, verifier_options={"wall_s": 5})
        runtime.run_job_inline(job)
        page = web.get(f"/jobs/{job.pk}/").content.decode()
        return job, page

    job, page = run_job("rlimits")
    assert all(r.data["sandbox"].startswith("rlimits only") for r in Rollout.objects.filter(job=job, status="ok"))
    assert 'id="collection-sandbox"' in page and "rlimits only, the operator&#x27;s choice" in page
    # a worker without namespaces (simulated here by an impossible choice): each verification fails, with why
    job, page = run_job("none-such")
    failed = list(Rollout.objects.filter(job=job))
    assert failed and all(r.status == "failed" and r.failure_class == "verifier_error" for r in failed)
    assert all("SandboxUnavailable" in r.error and "not run" in r.error for r in failed)
    assert "code verification is refused" in page
