"""Threads that parse Python at once (traceback formatting in a `-P threads` worker does) must not fail with
Python 3.11's "AST constructor recursion depth mismatch" SystemError (CPython gh-106905)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Four threads parse while the garbage collector's finalizers release the GIL in the middle of a parse: the
# moment the 3.11 race needs. The collector runs often (threshold 50); each finalizer leaves a new cycle behind.
RACE = textwrap.dedent("""
    import ast, gc, sys, threading, time
    if sys.argv[1] == "guarded":
        import workers  # noqa: F401
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50)

    class Cycle:
        def __init__(self):
            self.me = self
        def __del__(self):
            time.sleep(0.0002)
            Cycle()

    src = "f(" + ",".join(f"[{i}, ({i}, {{'a': [[[{i}]]]}})]" for i in range(50)) + ")"
    errors = []
    def parse_many():
        for _ in range(300):
            try:
                ast.parse(src)
            except SystemError as exc:
                errors.append(exc)
    Cycle()
    threads = [threading.Thread(target=parse_many) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(len(errors))
""")


def _race(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", RACE, mode], capture_output=True, text=True, timeout=120, check=True,
                         cwd=REPO)
    return int(out.stdout.strip())


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the AST constructor keeps its depth per call from 3.12")
def test_parsing_in_many_threads_never_fails_once_the_product_is_imported():
    guarded = _race("guarded")
    unguarded = _race("unguarded")
    assert guarded == 0, f"{guarded} SystemErrors in 1,200 parses with the product imported"
    if unguarded == 0:  # a later 3.11 release may fix it; then the guard is only a lock
        pytest.xfail("this interpreter showed no race in 1,200 unguarded parses")

