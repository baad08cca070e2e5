"""A verifier of adjustable cost for bench/bench_verify_cache.py: math's reward after `burn_ms` of CPU in the
verifier's process (an expensive checker -- a proof checker, a big regex, a unit test -- without its noise)."""
from __future__ import annotations

import time

from workers.verifiers import verifier, verify_row


@verifier(required_fields=("expected_answer",), options={"burn_ms": (float, 0.0)}, kind="cpu")
def costly_math(row, response_text, options):
    end = time.process_time() + options["burn_ms"] / 1000
    while time.process_time() < end:
        pass
    return verify_row("math", row, response_text)
