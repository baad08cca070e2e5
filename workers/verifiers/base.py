from __future__ import annotations

import hashlib
import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any


def operator_maxima(env: str | None = None) -> dict[str, float]:
    """VERIFIER_OPTION_MAX="code.wall_s=120,judge.concurrency=128": the operator's maxima for verifiers' numeric
    options, over each verifier's own `option_max`. {"code.wall_s": 120.0, ...}; ValueError for a bad entry."""
    text = os.environ.get("VERIFIER_OPTION_MAX", "") if env is None else env
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        name, dot, option = key.strip().partition(".")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or not dot or not name or not option or not math.isfinite(number) or number < 0:
            raise ValueError(f"VERIFIER_OPTION_MAX: {item!r} is not <verifier>.<option>=<number >= 0>")
        out[f"{name}.{option.strip()}"] = number
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class VerifyResult:
    reward: float
    fields: dict[str, Any] = field(default_factory=dict)  # verifier's own output fields (NeMo Gym style)


class Verifier:
    """A verifier scores one response against its task row. Subclass it (built-in or your own) and either
    `register` it or name it by dotted path / entry point (see workers.verifiers.registry).

    * `name`: the registry name.
    * `required_fields`: row fields the verifier reads; dotted for nested ones ("verifier_metadata.unit_tests").
      Checked against every dataset row when a job is launched (and at upload when a verifier is named).
    * `options`: {option: (type or tuple of types, default)}; `validate_options` checks a job's options
      against it (unknown options and wrong types are refused) and fills the defaults.
    * `kind`: "cpu" (runs in the engine's process pool), "io" (blocks on a subprocess or a file: runs in a
      thread), "remote" (an async call to another service: `averify`, on the event loop with its own limit).
    * `option_max`: {numeric option: the most a job may ask for}; the operator changes them with
      VERIFIER_OPTION_MAX. A job asking for more is refused (`validate_options`); where options are used they
      are clamped again (`clamp_options`: options stored before the operator lowered a maximum).
    """

    name = ""
    kind = ""  # "cpu" | "io" | "remote"; "" = older verifiers: `cpu_bound = True` -> cpu, else run on the loop
    required_fields: tuple[str, ...] = ("expected_answer",)
    options: dict[str, tuple] | None = None  # None: not declared (older verifiers): options pass unchecked
    description = ""
    version = ""  # bump when results change without a code change (a new model or data file behind it)
    option_max: dict[str, float] = {}
    record_options: frozenset[str] = frozenset()  # numeric options naming a stored record (an id), not an amount

    def option_caps(self) -> dict[str, float]:
        """{option: maximum} for this verifier: its own `option_max`, overridden by VERIFIER_OPTION_MAX."""
        caps = dict(self.option_max or {})
        for key, value in operator_maxima().items():
            name, _, option = key.partition(".")
            if name == self.name and option in (self.options or {}):
                caps[option] = value
        return caps

    def clamp_options(self, options: dict | None) -> dict:
        """The options with every numeric one within [0, its maximum]: above it -> the maximum; negative, NaN or
        infinite -> the default. For the places options are used (the worker), after the edge refused them."""
        out = dict(options or {}) if isinstance(options, dict) else {}
        declared = self.options or {}
        for key, cap in self.option_caps().items():
            value = out.get(key)
            if not _is_number(value):
                continue
            if not math.isfinite(value) or value < 0:
                out[key] = declared[key][1] if key in declared else 0
            elif value > cap:
                out[key] = type(value)(cap)
        return out

    def _source_of(self):
        return type(self)

    def fingerprint(self) -> str:
        """The declared version plus a hash of the module the verifier is written in: the verification cache
        keys on it, so edited verifier code never serves a result of the old code."""
        fp = self.__dict__.get("_fingerprint")
        if fp is None:
            obj = self._source_of()
            try:
                src = inspect.getsource(inspect.getmodule(obj) or obj)
            except (OSError, TypeError):
                src = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            digest = hashlib.blake2b(src.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
            fp = self.__dict__["_fingerprint"] = f"{self.version}-{digest}" if self.version else digest
        return fp

    @property
    def cpu_bound(self) -> bool:
        return self.kind == "cpu"

    @property
    def effective_kind(self) -> str:
        return self.kind or ("cpu" if self.cpu_bound else "loop")

    def verify(self, row: dict, response_text: str, options: dict) -> VerifyResult:
        raise NotImplementedError

    async def averify(self, row: dict, response_text: str, options: dict) -> VerifyResult:
        """Remote verifiers override this; the default runs `verify` (callers run sync kinds off the loop)."""
        return self.verify(row, response_text, options)

    def fast_verify(self, row: dict, response_text: str, options: dict) -> VerifyResult:
        """A cheap heuristic for `fast` mode; verifiers without one use the exact check."""
        return self.verify(row, response_text, options)

    @property
    def has_fast(self) -> bool:
        return type(self).fast_verify is not Verifier.fast_verify

    def required(self, options: dict | None = None) -> tuple[str, ...]:
        """Row fields needed with these options (an `answer_field` option renames `expected_answer`)."""
        options = options or {}
        answer_field = options.get("answer_field")
        if answer_field and "answer_field" in (self.options or {}):
            return tuple(answer_field if f == "expected_answer" else f for f in self.required_fields)
        return tuple(self.required_fields)

    def validate_options(self, options: dict | None) -> dict:
        """The options with defaults filled in; ValueError naming every bad option."""
        if options is not None and not isinstance(options, dict):
            raise ValueError("verifier options must be an object")
        options = dict(options or {})
        if self.options is None:
            return options
        errors = []
        caps = self.option_caps()
        for key in sorted(set(options) - set(self.options)):
            errors.append(f"unknown option {key!r} (known: {', '.join(sorted(self.options)) or 'none'})")
        out = {}
        for key, (types, default) in self.options.items():
            if key not in options:
                out[key] = default
                continue
            value = options[key]
            types_t = types if isinstance(types, tuple) else (types,)
            if float in types_t and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if (not isinstance(value, types_t) or (isinstance(value, bool) and bool not in types_t)) and value is not None:
                names = "/".join(t.__name__ for t in types_t)
                errors.append(f"option {key!r} must be {names}, not {type(value).__name__} {value!r}")
                continue
            if _is_number(value) and not (math.isfinite(value) and value >= 0):
                errors.append(f"option {key!r} must be a finite number >= 0, not {value!r}")
                continue
            if _is_number(value) and key in caps and value > caps[key]:
                errors.append(f"option {key!r} must be at most {caps[key]:g} (the operator's maximum: "
                              f"VERIFIER_OPTION_MAX {self.name}.{key}), not {value!r}")
                continue
            out[key] = value
        if errors:
            raise ValueError(f"verifier {self.name!r}: " + "; ".join(errors))
        return out

    def info(self) -> dict:
        return {"name": self.name, "kind": self.effective_kind, "required_fields": list(self.required_fields),
                "options": None if self.options is None else {
                    k: {"type": "/".join(t.__name__ for t in (v[0] if isinstance(v[0], tuple) else (v[0],))),
                        "default": v[1], **({"max": self.option_caps()[k]} if k in self.option_caps() else {})}
                    for k, v in self.options.items()},
                "description": self.description or (type(self).__doc__ or "").strip().split("\n")[0]}


VERIFIERS: dict[str, Verifier] = {}


def register(verifier_cls):
    VERIFIERS[verifier_cls.name] = verifier_cls()
    return verifier_cls


def get_verifier(name: str) -> Verifier:
    verifier = VERIFIERS.get(name)
    if verifier is not None:
        return verifier
    from .registry import resolve  # a dotted path or a package entry point

    return resolve(name)


def verify_row(name: str, row: dict, response_text: str, options: dict | None = None, fast: bool = False) -> VerifyResult:
    verifier = get_verifier(name)
    options = options or {}
    return verifier.fast_verify(row, response_text, options) if fast else verifier.verify(row, response_text, options)


@register
class NoVerifier(Verifier):
    """Collect only: no reward (used by deferred verification's collection phase)."""

    name = "none"
    required_fields = ()
    options = {}

    def verify(self, row, response_text, options):
        return VerifyResult(reward=0.0, fields={})
