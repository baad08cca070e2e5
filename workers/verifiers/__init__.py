"""Pluggable verifiers. A verifier scores one response against its task row.

Contract: `verify_row(name, row, response_text, options, fast=False) -> VerifyResult` is a module-level
function (picklable), so the engine can run CPU-bound verifiers in a process pool.
"""
from .base import VerifyResult, Verifier, get_verifier, register, verify_row, VERIFIERS  # noqa: F401
from . import match as _match  # noqa: F401  (registers exact / normalized)
from . import math as _math  # noqa: F401  (registers math)
from . import remote as _remote  # noqa: F401  (registers nemo_gym: a resources server's /verify)
