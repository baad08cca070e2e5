"""Run an untrusted program in a sandbox: Debian's bubblewrap (new user, PID, network, IPC, UTS and
mount namespaces; only /usr and the library directories visible, read-only; a throwaway working
directory as the only writable place; an empty environment) plus rlimits (CPU time, address space,
process count, file size, open files) and a wall-clock limit that kills the whole process group.

When the worker runs as root, the program runs under a throwaway uid, so the process-count limit binds
(root ignores RLIMIT_NPROC). Where the kernel refuses namespaces (or bwrap is missing) the fallback is
rlimits + a private temporary directory + a scrubbed environment + Python's isolated mode; `mode()`
says which one is in use and the code verifier reports it with every result.
"""
from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

PYTHON = "/usr/bin/python3"
BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
_UID_BASE, _UID_SPAN = 200000, 64000  # throwaway uids (root workers only); never in /etc/passwd
_UID_PER_PROCESS = 64  # uids a process hands out: base + (pid % 1000) * 64 + slot; never two runs on one uid
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_mode: str | None = None
_mode_reason = ""


@dataclass
class Limits:
    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 256
    processes: int = 16
    output_bytes: int = 1_000_000
    open_files: int = 64


@dataclass
class RunResult:
    status: str  # "ok" | "exit" | "timeout" | "cpu_limit" | "memory_limit" | "output_limit" | "killed" | "error"
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def reason(self) -> str:
        tail = (self.stderr.strip().splitlines() or [""])[-1][:300]
        return {
            "ok": "ok",
            "exit": f"exited with status {self.returncode}" + (f": {tail}" if tail else ""),
            "timeout": "wall-clock limit exceeded",
            "cpu_limit": "CPU-time limit exceeded",
            "memory_limit": "memory limit exceeded" + (f": {tail}" if tail else ""),
            "output_limit": "output-size limit exceeded",
            "killed": f"killed by signal {-(self.returncode or 0)}" + (f": {tail}" if tail else ""),
            "error": f"sandbox error: {tail}",
        }.get(self.status, self.status)


def _probe() -> tuple[str, str]:
    if not os.path.exists(BWRAP):
        return "rlimits", "bubblewrap is not installed"
    try:
        cmd = [BWRAP, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
               *_lib_links(), PYTHON, "-c", "pass"]
        kw = {}
        if os.geteuid() == 0:
            kw = {"user": _UID_BASE, "group": _UID_BASE, "extra_groups": []}
        proc = subprocess.run(cmd, capture_output=True, timeout=20, env={}, **kw)
    except (OSError, subprocess.SubprocessError) as exc:
        return "rlimits", f"bubblewrap failed to start: {exc}"
    if proc.returncode != 0:
        return "rlimits", "the kernel refused namespaces: " + proc.stderr.decode(errors="replace").strip()[:200]
    return "bubblewrap", ""


def mode() -> tuple[str, str]:
    """("bubblewrap", "") or ("rlimits", why namespaces are not in use). Probed once per process."""
    global _mode, _mode_reason
    if _mode is None:
        forced = os.environ.get("VERIFIER_SANDBOX", "")
        if forced == "rlimits":
            _mode, _mode_reason = "rlimits", "VERIFIER_SANDBOX=rlimits"
        else:
            _mode, _mode_reason = _probe()
    return _mode, _mode_reason


def _lib_links() -> list[str]:
    """Debian's merged /usr: /bin, /lib, /lib64, /sbin are symlinks into /usr."""
    out = []
    for d in ("bin", "lib", "lib64", "lib32", "libx32", "sbin"):
        p = "/" + d
        if os.path.islink(p):
            out += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            out += ["--ro-bind", p, p]
    return out


def _rlimits(limits: Limits, nproc: int):
    cpu = max(1, int(limits.cpu_s + 0.999))
    mem = limits.memory_mb * 1024 * 1024

    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _own_process_count() -> int:
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _take_uid() -> int:
    first = _UID_BASE + (os.getpid() % 1000) * _UID_PER_PROCESS
    with _uid_lock:
        while True:
            for uid in range(first, first + _UID_PER_PROCESS):
                if uid not in _uids_in_use:
                    _uids_in_use.add(uid)
                    return uid
            _uid_lock.release()  # more runs at once than slots: wait for one to end
            time.sleep(0.05)
            _uid_lock.acquire()


def _uid_pids(uid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    out.append(int(pid))
            except OSError:
                pass
    return out


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    # anything that escaped the group (setsid, the sandbox's own session) still runs under the throwaway
    # uid: kill it and wait until the kernel has reaped it, so the uid is clean for its next run
    deadline = time.monotonic() + 10
    while True:
        pids = _uid_pids(uid)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def run_python(code: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
    """Run `code` with Python 3 in the sandbox, `stdin` on its standard input."""
    limits = limits or Limits()
    sandbox, _ = mode()
    root = os.geteuid() == 0
    uid = _take_uid() if root else None
    tmp = tempfile.mkdtemp(prefix="verify-")
    try:
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        in_path, out_path, err_path = (os.path.join(tmp, n) for n in ("stdin", "stdout", "stderr"))
        with open(in_path, "w") as f:
            f.write(stdin or "")
        env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0"}
        if root:
            os.chown(work, uid, uid)
            os.chmod(tmp, 0o755)
        if sandbox == "bubblewrap":
            cmd = [BWRAP, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                   "--ro-bind", "/usr", "/usr", *_lib_links(), "--proc", "/proc", "--dev", "/dev",
                   "--tmpfs", "/tmp", "--bind", work, "/work", "--chdir", "/work", "--hostname", "sandbox"]
            for k, v in env.items():
                cmd += ["--setenv", k, v]
            cmd += [PYTHON, "-I", "-S", "main.py"]
            nproc = limits.processes + 2  # bwrap and its init
        else:
            cmd = [PYTHON, "-I", "-S", "main.py"]
            nproc = limits.processes
        if not root:
            nproc += _own_process_count()  # RLIMIT_NPROC counts every process of the uid
        kw = {"user": uid, "group": uid, "extra_groups": []} if root else {}
        t0 = time.monotonic()
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            try:
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env,
                                        start_new_session=True, preexec_fn=_rlimits(limits, nproc), close_fds=True, **kw)
            except OSError as exc:
                return RunResult("error", None, "", f"could not start the sandbox: {exc}", 0.0)
            timed_out = False
            try:
                rc = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            if timed_out:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                rc = proc.wait()
            _kill_all(proc, uid)
        wall = time.monotonic() - t0
        stdout = _read(out_path, limits.output_bytes)
        stderr = _read(err_path, 20_000)
        if timed_out:
            status = "timeout"
        elif rc == 0:
            status = "ok"
        elif rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU) or (rc == -signal.SIGKILL and wall < limits.wall_s and "MemoryError" not in stderr and _cpu_exhausted(wall, limits)):
            status = "cpu_limit"
        elif rc in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or os.path.getsize(out_path) >= limits.output_bytes:
            status = "output_limit"
        elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
            status = "memory_limit"
        elif rc is not None and rc < 0:
            status = "killed"
        else:
            status = "exit"
        return RunResult(status, rc, stdout, stderr, wall)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)


def _cpu_exhausted(wall: float, limits: Limits) -> bool:
    return wall >= limits.cpu_s


def _read(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""
