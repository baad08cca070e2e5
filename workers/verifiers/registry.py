"""Users' own verifiers: by dotted path or through a package entry point, same contract as the built-ins.

A job's `verifier` is a registered name ("math", "mcqa", "code", "judge", ...), a dotted path
("mypkg.checks:ends_with_period" or "mypkg.checks.EndsWithPeriod"), or the name of an entry point in
the `rollout_controlplane.verifiers` group of an installed package. The object must be a Verifier
subclass, or a function marked with the `verifier` decorator:

    from workers.verifiers import verifier

    @verifier(required_fields=("expected_answer",), options={"suffix": (str, ".")}, kind="cpu")
    def ends_with(row, response_text, options):
        return 1.0 if response_text.strip().endswith(options["suffix"]) else 0.0   # or a VerifyResult

Only marked objects are accepted, so a dotted path cannot call an arbitrary function of the environment.
But importing a module runs it: a dotted path is the operator's to name (the command line, VERIFIER_PLUGINS).
Users (the API, the dashboard) name registered verifiers and entry points; a dotted path of theirs is taken
only into a module the operator listed (`check_user_name`), and nothing is imported before that check.
"""
from __future__ import annotations

import importlib
import inspect
import re
import threading
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable

from .base import VERIFIERS, Verifier, VerifyResult

ENTRY_POINT_GROUP = "rollout_controlplane.verifiers"
_lock = threading.Lock()
_MISSING = object()
_by_path: dict[str, Verifier] = {}  # dotted paths resolved in this process (not names anyone registered)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_ATTR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def split_path(path: str) -> tuple[str, str]:
    """(module, attribute) of "pkg.mod:obj" or "pkg.mod.Obj"; ValueError for anything else (relative paths
    such as ".mod:x", empty parts, characters no module name has)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not _MODULE.fullmatch(module_name or "") or not _ATTR.fullmatch(attr or ""):
        raise ValueError(f"unknown verifier {path[:200]!r}: not a registered name, nor a dotted path 'module:object'")
    return module_name, attr


def check_user_name(name, allowed_modules=()) -> None:
    """ValueError unless a user may name this verifier: a registered name, an installed entry point, or a
    dotted path `module:object` / `module.Object` into one of `allowed_modules` (the operator's list). Imports
    nothing: an unknown or refused name never reaches importlib."""
    if not isinstance(name, str) or not name:
        raise ValueError("a verifier name is required")
    with _lock:
        if name in VERIFIERS:
            return
    if _entry_point(name) is not None:
        return
    if "." not in name and ":" not in name:
        raise ValueError(f"unknown verifier {name[:200]!r}; known: {', '.join(known_names())}")
    module_name, attr = split_path(name)
    if module_name not in set(allowed_modules) or "." in attr:
        raise ValueError(f"verifier {name[:200]!r}: a dotted path names a module, which only the operator may have "
                         f"imported; name a registered verifier ({', '.join(known_names())}), or ask the operator "
                         "to list the module in VERIFIER_PATH_MODULES")


class FunctionVerifier(Verifier):
    """Wraps a function `(row, response_text, options) -> float | VerifyResult | (reward, fields)`."""

    def __init__(self, fn: Callable, name: str, *, required_fields=(), options=None, kind="cpu", fast=None,
                 description="", version=""):
        self.fn = fn
        self.version = version
        self.fast_fn = fast
        self.name = name
        self.required_fields = tuple(required_fields)
        self.options = dict(options or {})
        self.kind = kind
        self.description = description or (fn.__doc__ or "").strip().split("\n")[0]

    def _source_of(self):
        return self.fn

    @staticmethod
    def _result(value) -> VerifyResult:
        if isinstance(value, VerifyResult):
            return value
        if isinstance(value, tuple) and len(value) == 2:
            return VerifyResult(reward=float(value[0]), fields=dict(value[1]))
        if isinstance(value, bool) or isinstance(value, (int, float)):
            return VerifyResult(reward=float(value))
        raise TypeError(f"verifier {getattr(value, '__name__', '')} returned {type(value).__name__}; "
                        "expected a number, a VerifyResult or (reward, fields)")

    def verify(self, row, response_text, options):
        return self._result(self.fn(row, response_text, options))

    async def averify(self, row, response_text, options):
        value = self.fn(row, response_text, options)
        if inspect.isawaitable(value):
            value = await value
        return self._result(value)

    def fast_verify(self, row, response_text, options):
        if self.fast_fn is None:
            return self.verify(row, response_text, options)
        return self._result(self.fast_fn(row, response_text, options))

    @property
    def has_fast(self) -> bool:
        return self.fast_fn is not None


def verifier(fn: Callable | None = None, *, required_fields: Iterable[str] = ("expected_answer",),
             options: dict | None = None, kind: str = "cpu", fast: Callable | None = None, version: str = ""):
    """Mark a function as a verifier usable by dotted path or entry point. `version`: bump it when results
    change without a code change (cached results are keyed by it and by a hash of the function's module)."""
    if kind not in ("cpu", "io", "remote"):
        raise ValueError(f"kind must be cpu, io or remote, not {kind!r}")

    def mark(f):
        f.__verifier__ = {"required_fields": tuple(required_fields), "options": dict(options or {}), "kind": kind,
                          "fast": fast, "version": str(version)}
        return f

    return mark(fn) if fn is not None else mark


def _import(path: str) -> Any:
    module_name, attr = split_path(path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"verifier {path!r}: cannot import module {module_name!r}: {exc}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            raise ValueError(f"verifier {path!r}: module {module_name!r} has no {attr!r}")
    return obj


def _from_object(obj: Any, name: str) -> Verifier:
    if inspect.isclass(obj) and issubclass(obj, Verifier):
        inst = obj()
        inst.name = name
        return inst
    if isinstance(obj, Verifier):
        return obj
    marks = getattr(obj, "__verifier__", None)
    if callable(obj) and isinstance(marks, dict):
        return FunctionVerifier(obj, name, **marks)
    raise ValueError(f"verifier {name!r} is {type(obj).__name__}: a verifier must be a Verifier subclass or a "
                     "function marked with @workers.verifiers.verifier")


def _entry_point(name: str):
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep
    return None


def resolve(name: str) -> Verifier:
    """The verifier for a registered name, an entry point name or a dotted path (cached once loaded)."""
    if not isinstance(name, str) or not name:
        raise ValueError("a verifier name is required")
    with _lock:
        if name in VERIFIERS:
            return VERIFIERS[name]
        if name in _by_path:
            return _by_path[name]
    ep = _entry_point(name)
    if ep is not None:
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001  (a broken plugin is a clear error, not a crash)
            raise ValueError(f"verifier {name!r}: entry point {ep.value!r} failed to load: {type(exc).__name__}: {exc}") from None
    elif "." in name or ":" in name:
        inst = _from_object(_import(name), name)
        with _lock:
            return _by_path.setdefault(name, inst)
    else:
        raise ValueError(f"unknown verifier {name[:200]!r}; known: {', '.join(sorted(VERIFIERS))} "
                         f"(or a dotted path 'module:object', or an entry point in {ENTRY_POINT_GROUP!r})")
    inst = _from_object(obj, name)
    with _lock:
        VERIFIERS.setdefault(name, inst)
        return VERIFIERS[name]


def known_names() -> list[str]:
    """Registered names plus installed entry points (dotted paths are the operator's: see check_user_name)."""
    names = set(VERIFIERS)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def has_field(row: dict, path: str) -> bool:
    obj: Any = row
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj or obj[part] is None:
            return False
        obj = obj[part]
    return True


def missing_fields(required: Iterable[str], rows: Iterable[tuple[int, dict]], limit: int = 100) -> tuple[int, list[dict]]:
    """Check `(line_number, row)` pairs for the required fields. Returns (rows lacking any, the first
    `limit` of them as {"line", "missing"})."""
    required = tuple(required)
    count, report = 0, []
    if not required:
        return 0, []
    for line, row in rows:
        missing = [f for f in required if not has_field(row, f)]
        if missing:
            count += 1
            if len(report) < limit:
                report.append({"line": line, "missing": missing})
    return count, report


def describe_missing(name: str, count: int, report: list[dict]) -> str:
    shown = "; ".join(f"line {r['line']}: {', '.join(r['missing'])}" for r in report[:20])
    more = f" (and {count - 20} more)" if count > 20 else ""
    return f"{count} row(s) lack fields verifier {name!r} needs: {shown}{more}"


FIT_LINES_KEPT = 20  # line numbers kept per verifier in an upload's fit report (the count is always exact)


def fit_candidates(extra: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
    """{verifier name: required row fields} for every verifier a dataset could be checked against: the
    registered ones, installed entry points (a plugin that fails to load is left out) and `extra` names."""
    out: dict[str, tuple[str, ...]] = {}
    extra = [name for name in extra if name]
    # dotted paths resolved earlier in this process are one job's choice, not part of every dataset's list
    names = [n for n in known_names() if "." not in n and ":" not in n]
    for name in [*names, *extra]:
        if name == "none" or name in out:
            continue
        try:
            out[name] = tuple(resolve(name).required())
        except ValueError:
            continue
    return out


class FieldFit:
    """Which verifiers a dataset's rows can serve, computed while the rows stream past (constant memory):
    per verifier, how many rows lack a field it reads, which fields, and the first line numbers.

    A row is counted under its signature (the fields it lacks, of all the verifiers'), with the signature's first
    `keep` line numbers; `result` folds the signatures into each verifier's figures. The rows of a dataset share
    a few signatures, so a row costs its field lookups and one counter, not a pass over every verifier."""

    def __init__(self, required: dict[str, tuple[str, ...]], keep: int = FIT_LINES_KEPT):
        self.required = {name: tuple(fields) for name, fields in required.items()}
        self.keep = keep
        self._all_fields = tuple(sorted({f for fields in self.required.values() for f in fields}))
        self._rows: dict[tuple[str, ...], int] = {}  # lacked fields -> rows
        self._lines: dict[tuple[str, ...], list[int]] = {}  # lacked fields -> its first `keep` line numbers

    def add(self, line: int, row: dict) -> None:
        lacked = tuple([f for f in self._all_fields if not has_field(row, f)])
        rows = self._rows.get(lacked)
        if rows is None:
            self._rows[lacked], self._lines[lacked] = 1, [line]
            return
        self._rows[lacked] = rows + 1
        if rows < self.keep:
            self._lines[lacked].append(line)

    def result(self) -> dict[str, dict]:
        """{name: {"required", "fits", "lacking_rows", "lines" (the first ones), "missing" {field: rows}}}"""
        out = {}
        for name, fields in sorted(self.required.items()):
            lacking, lines, missing = 0, [], {}
            for lacked, rows in self._rows.items():
                hit = [f for f in fields if f in lacked]
                if not hit:
                    continue
                lacking += rows
                lines += self._lines[lacked]
                for f in hit:
                    missing[f] = missing.get(f, 0) + rows
            out[name] = {"required": list(fields), "fits": lacking == 0, "lacking_rows": lacking,
                         "lines": sorted(lines)[:self.keep], "missing": missing}
        return out


def describe_fit(fit: dict[str, dict]) -> str:
    """One line for people: "fits verifiers: exact, math; code needs verifier_metadata.unit_tests (missing in
    lines 3, 17, … — 40 rows)"."""
    fits = [name for name, f in fit.items() if f["fits"]]
    parts = [f"fits verifiers: {', '.join(fits) if fits else 'none'}"]
    for name, f in fit.items():
        if f["fits"]:
            continue
        shown = ", ".join(str(n) for n in f["lines"])
        more = ", …" if f["lacking_rows"] > len(f["lines"]) else ""
        parts.append(f"{name} needs {', '.join(f['missing'])} (missing in line{'s' if f['lacking_rows'] > 1 else ''} "
                     f"{shown}{more}; {f['lacking_rows']} row{'s' if f['lacking_rows'] > 1 else ''})")
    return "; ".join(parts)
