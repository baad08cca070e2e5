"""Pluggable verifiers. A verifier scores one response against its task row.

Contract: `verify_row(name, row, response_text, options, fast=False) -> VerifyResult` is a module-level
function (picklable), so the engine can run CPU-bound verifiers in a process pool. Users bring their own
verifier by dotted path or entry point (registry.py).
"""
from .base import VerifyResult, Verifier, get_verifier, register, verify_row, VERIFIERS  # noqa: F401
from .registry import verifier, missing_fields, known_names  # noqa: F401
from . import match as _match  # noqa: F401  (registers exact / normalized)
from . import math as _math  # noqa: F401  (registers math)
from . import mcqa as _mcqa  # noqa: F401  (registers mcqa)
from . import codeexec as _codeexec  # noqa: F401  (registers code)
from . import judge as _judge  # noqa: F401  (registers judge)
from . import remote as _remote  # noqa: F401  (registers nemo_gym: a resources server's /verify)


def _load_plugins() -> None:
    """VERIFIER_PLUGINS=pkg.mod,other.mod: modules that register more verifiers (imported here, so the
    engine's verifier processes have them too)."""
    import importlib
    import os

    for name in filter(None, (m.strip() for m in os.environ.get("VERIFIER_PLUGINS", "").split(","))):
        importlib.import_module(name)


_load_plugins()
