"""The shipped image must have the code verifier's sandbox: the issue found no bubblewrap in docker/Dockerfile,
so every submitted program ran in the rlimits fallback and read the worker's secrets.

Read here (no image is built): the Dockerfile installs every file the sandbox probe runs (bubblewrap, the
sandbox's Python, libseccomp: their Debian packages, resolved with dpkg on this Debian bookworm, the image's
base) and the Python packages it imports; every process runs as an unprivileged user; nothing opts into
rlimits; the worker services carry the container settings bubblewrap needs. Then the probe itself, run as the
image's user would run it (that uid, no capabilities, no_new_privs, Debian's /usr/bin/python3, only the
sandbox module and pyseccomp), finds bubblewrap, not rlimits."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

import pyseccomp
from workers.verifiers import sandbox

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((REPO / "docker" / "compose.yml").read_text())
GPU_COMPOSE = yaml.safe_load((REPO / "docker" / "compose.gpu-host.yml").read_text())
WORKER_SECURITY_OPT = {"seccomp=unconfined", "apparmor=unconfined", "no-new-privileges:true"}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in DOCKERFILE.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in text.splitlines() if ln.strip()]


def apt_packages() -> set[str]:
    out = set()
    for op, args in _instructions():
        if op != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            words = shlex.split(command)
            if words[:2] == ["apt-get", "install"]:
                out |= {w for w in words[2:] if not w.startswith("-")}
    return out


def _depends(package: str) -> set[str]:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Depends},${Pre-Depends}", package], capture_output=True,
                          text=True)
    names = set()
    for alternative in re.split(r"[,|]", proc.stdout):
        name = alternative.strip().split(" ")[0].split(":")[0]
        if name:
            names.add(name)
    return names


def installed_by(packages: set[str], depth: int = 4) -> set[str]:
    """The packages and what they pull in (Depends, Pre-Depends), as dpkg knows them here."""
    seen, frontier = set(packages), set(packages)
    for _ in range(depth):
        frontier = set().union(*(_depends(p) for p in frontier)) - seen
        seen |= frontier
    return seen


def owner_package(path: str) -> str:
    for candidate in (os.path.realpath(path), "/usr" + os.path.realpath(path) if not path.startswith("/usr") else path):
        proc = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout.split(":")[0].strip()
    raise AssertionError(f"no Debian package holds {path}")


needs_debian = pytest.mark.skipif(not shutil.which("dpkg-query"), reason="dpkg is needed to read Debian packages")


@pytest.mark.slow
@needs_debian
def test_the_image_installs_every_file_the_sandbox_probe_runs():
    packages = apt_packages()
    assert "bubblewrap" in packages, packages
    provided = installed_by(packages)
    libseccomp = next(line.split("=>")[1].strip() for line in subprocess.run(
        ["ldconfig", "-p"], capture_output=True, text=True).stdout.splitlines() if "libseccomp.so.2 " in line)
    for path in (sandbox.BWRAP, sandbox.PYTHON, libseccomp):
        assert owner_package(path) in provided, (path, owner_package(path), sorted(packages))
    requirements = (REPO / "requirements.txt").read_text()
    assert re.search(r"^pyseccomp==", requirements, re.M) and re.search(r"^google-re2==", requirements, re.M)
    assert any(op == "RUN" and "pip install -r requirements.txt" in args for op, args in _instructions())


def test_every_process_runs_unprivileged_and_nothing_opts_into_rlimits():
    users = [args.strip() for op, args in _instructions() if op == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    assert "VERIFIER_SANDBOX" not in DOCKERFILE or "VERIFIER_SANDBOX=rlimits" not in DOCKERFILE
    for compose in (COMPOSE, GPU_COMPOSE):
        for name, service in compose["services"].items():
            env = service.get("environment") or {}
            assert str(env.get("VERIFIER_SANDBOX", "")).lower() != "rlimits", name
            assert service.get("user") in (None, "app", "1000"), name


def test_worker_services_carry_what_bubblewrap_needs():
    for compose in (COMPOSE, GPU_COMPOSE):
        worker = compose["services"]["worker"]
        assert WORKER_SECURITY_OPT <= set(worker.get("security_opt") or []), worker.get("security_opt")
        assert worker.get("cap_drop") == ["ALL"]
    # documented where an operator reads it
    text = (REPO / "docker" / "compose.yml").read_text()
    assert "apparmor_restrict_unprivileged_userns" in text and "VERIFIER_SANDBOX=rlimits" in text


@needs_debian
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="switching to the image's uid needs root")
def test_the_probe_as_the_images_user_finds_bubblewrap():
    uid = int(re.search(r"useradd[^\n]*--uid (\d+)", DOCKERFILE).group(1))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}
    for op, args in _instructions():  # the image's ENV lines
        if op == "ENV":
            env.update(dict(pair.split("=", 1) for pair in shlex.split(args) if "=" in pair))
    tmp = tempfile.mkdtemp(prefix="probe-as-app-")
    try:
        shutil.copy(REPO / "workers" / "verifiers" / "sandbox.py", tmp)
        shutil.copy(pyseccomp.__file__, tmp)
        os.chmod(tmp, 0o755)
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        probe = (f"import sys; sys.path.insert(0, {tmp!r}); import sandbox; mode, why = sandbox.mode(); "
                 "r = sandbox.run_python('import os; print(os.getuid())'); print(mode, '|', why, '|', r.status, '|', r.stdout)")
        proc = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                               "--bounding-set=-all", "--inh-caps=-all", sandbox.PYTHON, "-c", probe],
                              capture_output=True, text=True, timeout=60, env=env, cwd=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mode, why, status, out = (p.strip() for p in proc.stdout.split("|"))
    assert mode == "bubblewrap", why
    assert status == "ok" and out == str(uid)
