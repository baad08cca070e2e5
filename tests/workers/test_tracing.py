"""workers/tracing.py without the control plane: off, a run never loads OpenTelemetry; on, a dead OTLP endpoint
costs the run nothing it can see: its end waits only until its spans are in the exporter process's pipe."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import pytest

from workers.diagnosis.scenarios import rows_math, task_items
from workers.engine.runner import run_collection_sync
from workers.engine.types import CollectionSpec, EndpointSpec
from workers.tracing import TraceConfig, run_tracer, sampled


class Sink:
    def __init__(self):
        self.results = []

    async def rollout(self, r):
        self.results.append(r)

    async def progress(self, t):
        pass

    async def close(self):
        pass


@pytest.mark.slow
def test_off_never_imports_opentelemetry(simulator):
    code = textwrap.dedent(f"""
        import sys
        from workers.diagnosis.scenarios import rows_math, task_items
        from workers.engine.runner import run_collection_sync
        from workers.engine.types import CollectionSpec, EndpointSpec
        import workers.nemo_gym.engine
        from tests.workers.test_tracing import Sink
        sink = Sink()
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[{simulator.url!r}], model={simulator.model!r}),
                              parallelism=4, verifier="none")
        s = run_collection_sync(spec, task_items(rows_math(20)), sink)
        assert s.completed == 20 and all(r.trace_id for r in sink.results)
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert run_tracer(None) is None and run_tracer(TraceConfig(mode="otlp", endpoint="")) is None


@pytest.mark.slow
def test_a_dead_collector_costs_the_run_nothing(simulator):
    """Connection refused at the collector (the exporter process retrying with backoff): the run ends as soon as
    without tracing, give or take; it waited out a 5 s flush before."""

    def run(tracing):
        sink = Sink()
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[simulator.url], model=simulator.model), parallelism=8,
                              verifier="none", tracing=tracing)
        t0 = time.monotonic()
        summary = run_collection_sync(spec, task_items(rows_math(200)), sink)
        return summary, time.monotonic() - t0

    _, off = run(None)
    summary, dead = run(TraceConfig(mode="otlp", endpoint="http://127.0.0.1:9/v1/traces", job_key="dead"))
    assert summary.completed == 200 and not summary.fatal_error
    assert dead < off + 3.0, (off, dead)


def test_sampling_is_by_trace_id():
    import random

    rnd = random.Random(7)
    ids = [f"{rnd.getrandbits(128):032x}" for _ in range(20000)]
    share = sum(sampled(t, 0.25) for t in ids) / len(ids)
    assert 0.23 < share < 0.27
    assert [sampled(t, 0.25) for t in ids[:500]] == [sampled(t, 0.25) for t in ids[:500]]  # a function of the id
    assert all(sampled(t, 1.0) for t in ids[:100]) and not any(sampled(t, 0.0) for t in ids[:100])


def test_request_span_and_its_traceparent():
    """The engine's one-call request span: the header it returns names that span under the rollout's trace, and
    the span ends with the answer's weight version; an unsampled rollout gets no span (the engine then sends a
    plain traceparent)."""
    import re

    from workers.engine.types import RolloutResult

    tracer = run_tracer(TraceConfig(mode="spans"))
    result = RolloutResult(task_index=3, rollout_index=1, ok=False, output_row={}, trace_id="ab" * 16)
    assert tracer.request(result, "http://m/v1/chat/completions") == (None, "")  # its rollout span not started
    tracer.rollout_start(result)
    span, header = tracer.request(result, "http://m/v1/chat/completions")
    m = re.fullmatch(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01", header)
    assert m and m.group(1) == result.trace_id and int(m.group(2), 16) == span[2] != 0
    assert span[0] == "request" and span[1] == int(result.trace_id, 16) and span[4] == 2 and span[6] == 0
    assert span[7] == {"url.full": "http://m/v1/chat/completions", "request.attempt": 1}
    tracer.request_done(span, "v7")
    assert span[6] >= span[5] > 0 and span[7]["gen_ai.response.weight_version"] == "v7"
    ended = span[6]
    tracer.request_done(span, "v8")  # ending twice changes nothing
    assert span[6] == ended and span[7]["gen_ai.response.weight_version"] == "v7"
    second, header2 = tracer.request(result, "http://m/v1/chat/completions")
    assert second[2] != span[2] and header2 != header  # a span (and a traceparent) per attempt
