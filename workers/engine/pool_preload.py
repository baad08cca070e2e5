"""Imported by the verifier pool's fork server before it forks any pool process (verify_pool._mp_context): runs
the math verifier once there, so math-verify's and sympy's lazy set-up (parsers, caches: ~70 ms a process) is
done once and every pool process is forked warm. Never raises: a pool process warms itself as before."""
from __future__ import annotations

try:
    from workers.verifiers import verify_row

    verify_row("math", {"expected_answer": "2"}, "The answer is \\boxed{2}")
except Exception:  # noqa: BLE001
    pass
