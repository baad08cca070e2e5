"""Run an untrusted program in a sandbox: Debian's bubblewrap (new user, PID, network, IPC, UTS and
mount namespaces; only /usr and the library directories visible, read-only; no /proc; the root, /dev and
/usr read-only; the working directory, /tmp and /dev/shm small tmpfs mounts of VERIFIER_SANDBOX_TMPFS_MB
each; an empty environment; no further user namespaces (`--disable-userns` where bwrap has it, and a
seccomp filter either way) and no ptrace, cross-process memory access, mounts, keyrings or BPF) plus
rlimits (CPU time, address space, process count, file size, open files) and a wall-clock limit that kills
the whole process group.

When the worker runs as root, the program runs under a throwaway uid, so the process-count limit binds
(root ignores RLIMIT_NPROC).

Fails closed: where bubblewrap is missing or the kernel refuses namespaces, `mode()` is "unavailable" and
`run_python` raises SandboxUnavailable (the code verifier fails each verification with that reason).
Only an operator who sets VERIFIER_SANDBOX=rlimits gets the weaker fallback (rlimits + a private temporary
directory + a scrubbed environment + Python's isolated mode: the program can read what the worker's user
can read and reach the network); results then say "rlimits only" (each rollout's `sandbox` field, the job
page).
"""
from __future__ import annotations

import errno
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
_modes: dict[str, tuple[str, str]] = {}  # VERIFIER_SANDBOX value -> (mode, reason), probed once per process
_probe_lock = threading.Lock()
_bpf: bytes | None = None
_bwrap_flags: set[str] | None = None

OPT_IN = "rlimits"  # VERIFIER_SANDBOX=rlimits: the operator accepts the weaker sandbox
DEFAULT_TMPFS_MB = 16


class SandboxUnavailable(RuntimeError):
    """No namespace sandbox here and the operator did not opt into rlimits: the program is not run."""


def tmpfs_mb() -> int:
    """VERIFIER_SANDBOX_TMPFS_MB: the size of each writable place in the sandbox (work dir, /tmp, /dev/shm)."""
    try:
        return max(1, int(os.environ.get("VERIFIER_SANDBOX_TMPFS_MB") or DEFAULT_TMPFS_MB))
    except ValueError:
        return DEFAULT_TMPFS_MB


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


# Syscalls the sandboxed program never needs and that widen what it can reach: tracing and reading other
# processes' memory, new namespaces (nested user namespaces above all), mounts, keyrings, BPF, perf, io_uring,
# userfaultfd, kernel modules. Refused with EPERM (clone3 with ENOSYS: its flags cannot be inspected, and libc
# falls back to clone, whose namespace flags are).
_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "mount", "umount2", "pivot_root",
           "chroot", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
           "open_by_handle_at", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
           "move_mount", "fsopen", "fsmount", "open_tree")
_CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)


def seccomp_filter() -> bytes:
    """The program's seccomp filter as BPF (libseccomp through pyseccomp; built once per process). Other
    architectures' system calls (i386 on x86-64) are killed: libseccomp's default for a foreign arch."""
    global _bpf
    if _bpf is None:
        import pyseccomp as sc

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for name in _DENIED:
            try:
                f.add_rule(sc.ERRNO(errno.EPERM), name)
            except (RuntimeError, ValueError, OSError):  # not a syscall on this architecture
                pass
        for flag in _CLONE_NS_FLAGS:
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        try:
            f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        except (RuntimeError, ValueError, OSError):
            pass
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            _bpf = out.read()
    return _bpf


def _bwrap_supports() -> set[str]:
    """The optional bwrap flags this bwrap has (--disable-userns came in 0.8.0)."""
    global _bwrap_flags
    if _bwrap_flags is None:
        try:
            text = subprocess.run([BWRAP, "--help"], capture_output=True, text=True, timeout=20, env={}).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        _bwrap_flags = {f for f in ("--disable-userns", "--assert-userns-disabled", "--size") if f in text}
    return _bwrap_flags


def _bwrap_command(main: str, size_bytes: int, seccomp_fd: int) -> list[str]:
    size = str(size_bytes)
    userns = [f for f in ("--disable-userns", "--assert-userns-disabled") if f in _bwrap_supports()]
    return [BWRAP, "--unshare-all", "--unshare-user", *userns, "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr", *_lib_links(), "--dev", "/dev",
            "--size", size, "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work",
            "--ro-bind", main, "/work/main.py", "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", "/work", "--hostname", "sandbox", "--seccomp", str(seccomp_fd)]


def _seccomp_fd() -> int:
    """A pipe holding the filter, for bwrap's --seccomp (it reads it whole); the caller closes it."""
    bpf = seccomp_filter()
    r, w = os.pipe()
    try:
        os.write(w, bpf)  # a few hundred bytes: well within a pipe's buffer
    finally:
        os.close(w)
    return r


def _probe() -> tuple[str, str]:
    """Run `python -c pass` in the same sandbox the programs get: ("bubblewrap", "") or ("unavailable", why)."""
    if not os.path.exists(BWRAP):
        return "unavailable", "bubblewrap is not installed"
    if not os.path.exists(PYTHON):
        return "unavailable", f"{PYTHON} (the sandbox's Python) is not installed"
    if "--size" not in _bwrap_supports():
        return "unavailable", "this bubblewrap cannot bound a tmpfs (--size needs bubblewrap >= 0.5)"
    try:
        fd = _seccomp_fd()
    except (ImportError, OSError, RuntimeError) as exc:
        return "unavailable", f"no seccomp filter (pyseccomp and libseccomp2 are needed): {exc}"
    tmp = tempfile.mkdtemp(prefix="verify-probe-")
    try:
        main = os.path.join(tmp, "main.py")
        with open(main, "w") as f:
            f.write("pass\n")
        os.chmod(tmp, 0o755)
        os.chmod(main, 0o644)
        cmd = [*_bwrap_command(main, 1 << 20, fd), PYTHON, "-I", "-S", "main.py"]
        kw = {}
        if os.geteuid() == 0:
            kw = {"user": _UID_BASE, "group": _UID_BASE, "extra_groups": []}
        proc = subprocess.run(cmd, capture_output=True, timeout=20, env={}, pass_fds=(fd,), **kw)
    except (OSError, subprocess.SubprocessError) as exc:
        return "unavailable", f"bubblewrap failed to start: {exc}"
    finally:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        return "unavailable", "the kernel refused namespaces: " + proc.stderr.decode(errors="replace").strip()[:200]
    return "bubblewrap", ""


def mode() -> tuple[str, str]:
    """("bubblewrap", ""), ("rlimits", why) when the operator opted in with VERIFIER_SANDBOX=rlimits, or
    ("unavailable", why namespaces cannot be used): then no program runs. Probed once per process."""
    choice = os.environ.get("VERIFIER_SANDBOX", "").strip().lower()
    with _probe_lock:
        if choice not in _modes:
            if choice == OPT_IN:
                _modes[choice] = ("rlimits", "VERIFIER_SANDBOX=rlimits: the operator's choice; programs can read "
                                             "what the worker's user can read and reach the network")
            elif choice not in ("", "bubblewrap"):
                _modes[choice] = ("unavailable", f"VERIFIER_SANDBOX={choice!r} is not bubblewrap or rlimits")
            else:
                _modes[choice] = _probe()
        return _modes[choice]


def describe(sandbox_mode: str, why: str) -> str:
    """How results and pages name the sandbox in use."""
    if sandbox_mode == "bubblewrap":
        return "bubblewrap"
    if sandbox_mode == "rlimits":
        return f"rlimits only ({why})"
    return f"unavailable ({why})"


def refusal(why: str) -> str:
    return (f"no sandbox for untrusted code: {why}. The program was not run. Install bubblewrap and allow user "
            "namespaces (see docker/compose.yml), or opt into the weaker rlimits sandbox with VERIFIER_SANDBOX=rlimits")


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
    """Tasks (threads included: RLIMIT_NPROC counts them) of this uid: a worker's own thread pools count."""
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
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
    """Run `code` with Python 3 in the sandbox, `stdin` on its standard input. SandboxUnavailable where there
    is no namespace sandbox and the operator did not opt into rlimits."""
    limits = limits or Limits()
    sandbox, why = mode()
    if sandbox == "unavailable":
        raise SandboxUnavailable(refusal(why))
    root = os.geteuid() == 0
    uid = _take_uid() if root else None
    tmp = tempfile.mkdtemp(prefix="verify-")
    seccomp_fd = None
    try:
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        main = os.path.join(work, "main.py")
        with open(main, "w") as f:
            f.write(code)
        in_path, out_path, err_path = (os.path.join(tmp, n) for n in ("stdin", "stdout", "stderr"))
        with open(in_path, "w") as f:
            f.write(stdin or "")
        env = {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0"}
        if root:
            os.chown(work, uid, uid)
            os.chmod(tmp, 0o755)
            os.chmod(main, 0o644)
        pass_fds: tuple[int, ...] = ()
        if sandbox == "bubblewrap":
            seccomp_fd = _seccomp_fd()
            pass_fds = (seccomp_fd,)
            cmd = _bwrap_command(main, tmpfs_mb() << 20, seccomp_fd)
            for k, v in env.items():
                cmd += ["--setenv", k, v]
            cmd += [PYTHON, "-I", "-S", "main.py"]
            nproc = limits.processes + 2  # bwrap and its init
        else:
            cmd = [PYTHON, "-I", "-S", "main.py"]
            nproc = limits.processes
        if not root:
            nproc += _own_process_count()  # RLIMIT_NPROC counts every task (thread) of the uid
        kw = {"user": uid, "group": uid, "extra_groups": []} if root else {}
        t0 = time.monotonic()
        with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
            try:
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env, pass_fds=pass_fds,
                                        start_new_session=True, preexec_fn=_rlimits(limits, nproc), close_fds=True, **kw)
            except OSError as exc:
                return RunResult("error", None, "", f"could not start the sandbox: {exc}", 0.0)
            finally:
                if seccomp_fd is not None:
                    os.close(seccomp_fd)
                    seccomp_fd = None
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
        if seccomp_fd is not None:
            os.close(seccomp_fd)
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
