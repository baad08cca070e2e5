"""Rollout sources: which run class collects a job, by endpoint kind or by verifier.

The built-in engine (`runner.CollectionRun`) talks to model servers (chat completions, completions, Responses API).
Other sources of rollouts - a NeMo Gym agent's `/run`, a model driven by the engine but scored by a remote
`/verify` - live in their own packages and register here when imported (workers.nemo_gym.engine does), so
the engine never imports them: the dependency runs one way, plugin -> engine.

A job whose endpoint kind is neither built in nor registered is refused with a clear error instead of being
sent to a model server it is not.
"""
from __future__ import annotations

BUILTIN_FLAVORS = frozenset({"chat_completions", "completions", "responses"})

_BY_FLAVOR: dict[str, type] = {}  # endpoint api_flavor -> run class
_BY_VERIFIER: dict[str, type] = {}  # verifier name -> run class (when verification is not deferred)


def register_flavor(flavor: str, run_class: type) -> None:
    """Jobs on endpoints of kind `flavor` run with `run_class` (a subclass of the engine's run)."""
    if flavor in BUILTIN_FLAVORS:
        raise ValueError(f"{flavor!r} is a built-in endpoint kind")
    _BY_FLAVOR[flavor] = run_class


def register_verifier(name: str, run_class: type) -> None:
    """Jobs that verify inline or fast with verifier `name` run with `run_class`."""
    _BY_VERIFIER[name] = run_class


def run_class_for(spec, default: type) -> type:
    """The run class for a CollectionSpec; ValueError for an endpoint kind nothing registered."""
    flavor = spec.endpoint.api_flavor
    if flavor not in BUILTIN_FLAVORS:
        try:
            return _BY_FLAVOR[flavor]
        except KeyError:
            known = ", ".join(sorted(BUILTIN_FLAVORS | set(_BY_FLAVOR)))
            raise ValueError(f"no rollout source for endpoint kind {flavor!r} (known: {known}); "
                             f"the package that provides it was not imported") from None
    if spec.verify_mode != "deferred" and spec.verifier in _BY_VERIFIER:
        return _BY_VERIFIER[spec.verifier]
    return default

