"""The collection command's fast start and exit (issue 28), Django-free: manage.py calls it for
`collect_rollouts` before Django is imported.

- `prewarm_from_argv(argv)`: when the run will verify with a CPU-bound verifier (the default `math`), the shared
  verifier pool is started and warmed in a background thread (fork server importing math-verify and sympy, each
  process running the verifier once) while the main thread imports and sets up Django; the engine then sends its
  first requests without waiting for the pool (answers that arrive before it is warm queue for verification).
- `quick_exit(code)`: after the command returned (summary printed, files written, rows committed; manage.py has
  closed the database connections), flush, stop the verifier processes and their fork server without waiting for
  them, and leave: no interpreter teardown (module finalizers, executor joins), which cost ~0.45 s after the
  summary.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

COMMAND = "collect_rollouts"


def _options(argv: list[str]) -> dict[str, str]:
    out = {}
    for arg in argv:
        if arg.startswith("+") and "=" in arg:
            key, value = arg[1:].split("=", 1)
            out[key.strip()] = value.strip().strip("'\"")
    return out


def prewarm_from_argv(argv: list[str]) -> threading.Thread | None:
    """Start warming the verifier pool for `manage.py collect_rollouts ...` (None: nothing to warm)."""
    if len(argv) < 3 or argv[1] != COMMAND or any(a in ("-h", "--help") for a in argv[2:]):
        return None
    opts = _options(argv[2:])
    split_verifier_pool(opts.get("engine_processes"))
    if opts.get("verify_mode", "inline") == "deferred":
        return None
    if opts.get("agent_name") and not (opts.get("model_base_url") or opts.get("policy_base_url")):
        return None  # a NeMo Gym agent run: the agents verify
    verifier = opts.get("verifier", "math")
    if verifier == "math" and opts.get("verify_mode") != "fast":
        _start_fork_server()  # its imports run on another core while this process imports what follows
    size = int(os.environ.get("VERIFY_POOL_PROCESSES") or 0) or None
    pool = _pool_to_warm(verifier, opts.get("verify_mode") == "fast")
    if pool is None:
        return None
    thread = threading.Thread(target=_warm, args=(pool, verifier, size), name="verify-pool-prewarm", daemon=True)
    thread.start()
    return thread


def split_verifier_pool(engine_processes) -> None:
    """+engine_processes=N: each of the N processes gets its own verifier pool, so each pool gets 1/N of the
    cores (VERIFY_POOL_PROCESSES, read by the settings and inherited by the children), not N pools of every core.
    An explicit VERIFY_POOL_PROCESSES is kept."""
    try:
        n = int(engine_processes or 1)
    except ValueError:
        return  # the command says what is wrong with the value
    if n > 1 and not os.environ.get("VERIFY_POOL_PROCESSES"):
        os.environ["VERIFY_POOL_PROCESSES"] = str(max(1, -(-(os.cpu_count() or 1) // n)))


def _start_fork_server() -> None:
    try:
        from workers.engine import forkserver

        forkserver.start()
    except Exception:  # noqa: BLE001  (the pool starts it itself)
        pass


def _pool_to_warm(verifier: str, fast: bool):
    """The shared verifier pool when `verifier` runs in it, else None; run in the main thread, which imports all
    that warming the pool needs, so the thread imports nothing while the main thread imports Django: CPython
    3.11's imports from two threads at once can fail (a settings import once died of "NameError: name 'sys' is
    not defined" in importlib while the thread imported aiohttp and importlib.metadata)."""
    try:
        import concurrent.futures.process  # noqa: F401 - what the pool's start imports on first use
        import multiprocessing.popen_fork  # noqa: F401
        import multiprocessing.popen_forkserver  # noqa: F401
        import multiprocessing.synchronize  # noqa: F401

        from workers.verifiers import VERIFIERS, get_verifier

        if verifier not in VERIFIERS:  # a dotted path or plug-in: the engine warms it as before
            return None
        v = get_verifier(verifier)
        if v.effective_kind != "cpu" or (fast and v.has_fast):
            return None
        from workers.engine.verify_pool import SHARED_VERIFY_POOL

        return SHARED_VERIFY_POOL
    except Exception:  # noqa: BLE001  (the engine warms the pool itself and reports what fails)
        return None


def _warm(pool, verifier: str, size: int | None) -> None:
    try:
        pool.prewarm(verifier, size)
    except Exception:  # noqa: BLE001  (the engine warms the pool itself and reports what fails)
        pass


def _kill_fork_server() -> None:
    """The verifier pool's fork server leaves by itself once this process is gone, but through an interpreter
    teardown of the math-verify and sympy it imported (0.14-0.21 s), holding this command's stdout and stderr
    meanwhile: whoever reads the command's output (a pipe, $(...), subprocess.run) waited that long after the
    command had exited. Its pool processes are killed already; nothing will ask it for another."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def quick_exit(code) -> None:
    """Leave now with `code` (an int, None, or a message as SystemExit carries it)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    pool = sys.modules.get("workers.engine.verify_pool")
    if pool is not None:
        pool.SHARED_VERIFY_POOL.kill()
    _kill_fork_server()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code or 0)
