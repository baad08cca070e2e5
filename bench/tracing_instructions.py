"""One engine run in this process, for counting what tracing costs in instructions and cache misses under valgrind
(deterministic where the bench's CPU ms/rollout on a shared host is not): a warm run of 300 rollouts, then `n`
rollouts against the simulator (zero latency, 16 tokens, verifier none, c=64), with tracing `off`, in mode `spans`
or in mode `spans` with nothing sampled (`s0`). The per-rollout figure is the difference of two counts over the
difference of their `n` (the start-up and the warm run cancel out):

    for a in "off 1000" "off 2000" "spans 1000" "spans 2000"; do set -- $a
      valgrind --tool=callgrind --cache-sim=yes --callgrind-out-file=/tmp/cg.$1.$2 \\
        .venv/bin/python -m bench.tracing_instructions $1 $2 2>&1 | grep -E "I   refs|I1  misses|D1  misses"
    done
    # per rollout: (count at 2000 - count at 1000) / 1000; callgrind_annotate --show=Ir,I1mr,D1mr per function

The simulator runs in a process of its own, not under valgrind.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench._common import CountingSink  # noqa: E402
from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import rows_math, task_items  # noqa: E402
from workers.engine.loop import run as run_on_loop  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402
from workers.tracing import TraceConfig  # noqa: E402


def spec_for(arm: str, url: str, model: str) -> CollectionSpec:
    tracing = None
    if arm in ("spans", "s0"):
        tracing = TraceConfig(mode="spans", job_key="bench", attributes={"job.id": 1},
                              sample_ratio=0.0 if arm == "s0" else 1.0)
    elif arm != "off":
        raise SystemExit(f"unknown arm {arm!r}: off, spans or s0")
    return CollectionSpec(endpoint=EndpointSpec(base_urls=[url], model=model), parallelism=64, verifier="none",
                          progress_interval_s=1.0, tracing=tracing)


def main() -> None:
    arm, n = sys.argv[1], int(sys.argv[2])
    sim = start_simulator(seed=0, ttft_ms=0, itl_ms=0, jitter=0, output_len_min=16, output_len_max=16)
    try:
        for count in (300, n):
            sink = CountingSink()
            run_on_loop(run_collection(spec_for(arm, sim.url, sim.model), task_items(rows_math(count)), sink))
            print(f"{arm}: {sink.ok} rollouts ok, {sink.failed} failed", flush=True)
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
