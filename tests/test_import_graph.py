"""The control plane's import graph: every module imports on its own, and imports run one way.

Two checks, both over every module under controlplane/:
* each module imports in a fresh process (forked after django.setup(), so one module's imports cannot
  hide another's missing or circular import);
* the graph of imports between controlplane modules - those at module level *and* those inside functions -
  has no cycle, so no import inside a function is there only to dodge a loop.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "controlplane"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imported(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, known) -> set[str]:
    """The controlplane modules an import statement loads (a package, and the submodules named from it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: None if is_package else -1]
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    return {n for n in names if n in known and n != module}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= imported(name, node, path.name == "__init__.py", known)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_find_cycle_finds_a_loop_through_a_function_level_import(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    src = "from . import b\n\ndef f():\n    from .c import x\n"
    node = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)]
    known = {"p.a", "p.b", "p.c"}
    assert imported("p.a", node[0], False, known) | imported("p.a", node[1], False, known) == {"p.b", "p.c"}


def test_controlplane_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 50  # every module was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


ISOLATED_IMPORTS = r"""
import importlib, os, sys, traceback
import django
django.setup()
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        failed.append(name)
print("FAILED:", " ".join(failed) if failed else "none")
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_every_controlplane_module_imports_on_its_own():
    names = sorted(modules())
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    proc = subprocess.run([sys.executable, "-c", ISOLATED_IMPORTS, *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "FAILED: none" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
