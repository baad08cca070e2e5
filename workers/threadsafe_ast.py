"""Python 3.11's AST constructor keeps its recursion depth in per-interpreter state, not per thread: when a thread
switch lands inside one `ast.parse` (a finalizer run by the garbage collector can release the GIL there) and
another thread parses meanwhile, the first one fails with "SystemError: AST constructor recursion depth
mismatch" (CPython gh-106905; 3.12 keeps it per call). `traceback` parses source lines to place its ^^^ marks, so
on 3.11 two threads formatting tracebacks at once (a `-P threads` worker, the web server's threads) can lose a log
record to that SystemError. Parsing under one lock costs nothing measurable: nothing here parses on a hot path."""
from __future__ import annotations

import ast
import functools
import sys
import threading

_lock = threading.RLock()


def install() -> bool:
    """Serialize `ast.parse` on interpreters with the shared depth; True if it is (now) serialized."""
    if sys.version_info >= (3, 12):
        return False
    if getattr(ast.parse, "_serialized", False):
        return True
    unlocked = ast.parse

    @functools.wraps(unlocked)
    def parse(*args, **kwargs):
        with _lock:
            return unlocked(*args, **kwargs)

    parse._serialized = True  # type: ignore[attr-defined]
    ast.parse = parse
    return True
