"""OpenTelemetry spans of a run: job -> chunk -> rollout -> request (and verify), exported over OTLP/HTTP.

Off by default. The engine asks `run_tracer(config)` once per run: None when tracing is off (the engine then
only tests `is None` -- nothing of OpenTelemetry is imported or called), else a RunTracer. The SDK is imported
lazily, on the first traced run, so a process that never traces never loads it.

Shape of the spans
------------------
* job: one span per job, trace id and span id derived from the job's key (`job_span_ids`), so every chunk of
  the job, in any worker process, names it as its parent without asking anyone; the control plane exports
  the job span itself when the job ends (`export_job_span`).
* chunk: one span per run of a chunk (a child of the job span), from the run's start to its end.
* rollout: one trace per rollout whose trace id is the rollout's stored `trace_id` (RolloutResult.trace_id, the
  one every model / agent / verifier request carries in `traceparent`), linked to its chunk's span: a rollout
  is looked up by its own trace id, and the link leads to the job.
* request: a child of the rollout span per attempt; its span id is the one sent in that request's
  `traceparent`, so the server's spans (vLLM, NeMo Gym) hang under it.
* verify: a child of the rollout span for the verification.

Modes: "off"; "spans" (spans made, never exported: what tracing costs without an exporter); "otlp" (batched
export to `endpoint`, an OTLP/HTTP traces URL such as http://collector:4318/v1/traces; flushed at the run's end).
The endpoint is the deployment's (a setting), never a user's.
"""
from __future__ import annotations

import hashlib
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("off", "spans", "otlp")
FLUSH_TIMEOUT_MS = 5000

_providers: dict[tuple, Any] = {}
_providers_lock = threading.Lock()


@dataclass
class TraceConfig:
    mode: str = "off"  # one of MODES
    endpoint: str = ""  # OTLP/HTTP traces URL (mode "otlp")
    service_name: str = "rollout-engine"
    job_key: str = ""  # the job's stable key: the chunk span's parent is the job span derived from it
    attributes: dict[str, Any] = field(default_factory=dict)  # on the chunk span (job.id, chunk.index ...)
    headers: dict[str, str] = field(default_factory=dict)  # sent with each export (an auth header)
    sample_ratio: float = 1.0  # the share of rollouts traced (by trace id, the same in every process)

    @property
    def enabled(self) -> bool:
        return self.mode in ("spans", "otlp") and (self.mode != "otlp" or bool(self.endpoint))


def job_span_ids(job_key: str) -> tuple[str, str]:
    """(trace id, span id) in hex of a job's span: derived from its key, the same in every process."""
    digest = hashlib.sha256(f"rollout-job:{job_key}".encode()).hexdigest()
    trace_id, span_id = digest[:32], digest[32:48]
    return (trace_id if trace_id.strip("0") else "1" * 32), (span_id if span_id.strip("0") else "1" * 16)


def _provider(config: TraceConfig):
    key = (config.mode, config.endpoint, config.service_name, tuple(sorted(config.headers.items())))
    with _providers_lock:
        provider = _providers.get(key)
        if provider is None:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
            if config.mode == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
                from opentelemetry.sdk.trace.export import BatchSpanProcessor

                provider.add_span_processor(BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=config.endpoint, headers=dict(config.headers) or None, timeout=10)))
            _providers[key] = provider
    return provider


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None and v != ""}


class _Span:
    """A span being recorded: plain slots, turned into an SDK ReadableSpan only when its rollout ends."""

    __slots__ = ("name", "span_id", "start_ns", "end_ns", "attributes", "error", "kind")

    def __init__(self, name: str, start_ns: int, attributes: dict[str, Any], kind: int = 0):
        self.name = name
        self.span_id = _span_id()
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.error = ""
        self.kind = kind


class _Rollout:
    __slots__ = ("trace_id", "root", "children")

    def __init__(self, trace_id: int, root: _Span):
        self.trace_id = trace_id
        self.root = root
        self.children: list[_Span] = []


def _span_id() -> int:
    return random.getrandbits(64) or 1


def sampled(trace_id: str, ratio: float) -> bool:
    """The W3C "random" trace-id bits (the low 56) against `ratio`: the same answer in every process."""
    if ratio >= 1.0:
        return True
    return ratio > 0.0 and (int(trace_id[-14:], 16) < ratio * (1 << 56))


class RunTracer:
    """The spans of one engine run (one chunk). Cheap by design: while a rollout runs its spans are a few slots
    each (no SDK call); when it ends they become SDK ReadableSpans handed to the exporter's processor at once
    (the SDK's own start_span costs ~10x more). Every method is quick and never raises into the engine."""

    def __init__(self, config: TraceConfig):
        from opentelemetry import trace
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self._ReadableSpan, self._SpanContext, self._Status, self._StatusCode = ReadableSpan, SpanContext, Status, StatusCode
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self._kinds = {0: SpanKind.INTERNAL, 2: SpanKind.CLIENT}
        self._ok = Status(StatusCode.UNSET)
        self.config = config
        self.ratio = float(config.sample_ratio)
        self.provider = _provider(config)
        self._processor = self.provider._active_span_processor  # noqa: SLF001 (finished spans go straight here)
        self._scope = InstrumentationScope("workers.engine")
        tracer = self.provider.get_tracer("workers.engine")
        parent = None
        if config.job_key:
            job_trace, job_span = job_span_ids(config.job_key)
            parent = trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(
                trace_id=int(job_trace, 16), span_id=int(job_span, 16), is_remote=True, trace_flags=self._flags)))
        self.chunk = tracer.start_span("chunk", context=parent, attributes=_clean(dict(config.attributes)))
        self._chunk_link = (Link(self.chunk.get_span_context()),)
        self._rollouts: dict[int, _Rollout] = {}  # id(RolloutResult) -> its spans, while it runs

    # ------------------------------------------------------------------ rollout
    def rollout_start(self, result, waited_s: float = 0.0) -> None:
        """Start the rollout's span (back-dated by the `waited_s` it spent queued); its trace id is
        result.trace_id. A rollout outside the sample ratio records nothing."""
        if self.ratio < 1.0 and not sampled(result.trace_id, self.ratio):
            return
        root = _Span("rollout", time.time_ns() - int(waited_s * 1e9),
                     {"rollout.task_index": result.task_index, "rollout.rollout_index": result.rollout_index})
        self._rollouts[id(result)] = _Rollout(int(result.trace_id, 16), root)

    def rollout_end(self, result, abandoned: bool = False) -> None:
        rec = self._rollouts.pop(id(result), None)
        if rec is None:
            return
        root = rec.root
        root.end_ns = time.time_ns()
        attrs = root.attributes
        attrs.update({"rollout.ok": bool(result.ok), "rollout.attempts": result.attempts,
                      "rollout.failure_class": result.failure_class, "rollout.reward": result.reward,
                      "gen_ai.usage.input_tokens": result.input_tokens, "gen_ai.usage.output_tokens": result.output_tokens,
                      "rollout.replica": result.replica, "rollout.weight_version": result.weight_version,
                      "rollout.queue_ms": result.queue_ms, "rollout.ttft_ms": result.ttft_ms,
                      "rollout.generation_ms": result.generation_ms, "rollout.verify_ms": result.verify_ms,
                      "rollout.wall_ms": result.wall_ms})
        if abandoned:
            attrs["rollout.abandoned"] = True
        elif not result.ok:
            root.error = (result.error or result.failure_class)[:200]
        self._finish(rec, root, None, self._chunk_link)
        for child in rec.children:
            if not child.end_ns:
                child.end_ns = root.end_ns
                child.error = child.error or "unfinished"
            self._finish(rec, child, root.span_id, ())

    def _finish(self, rec: _Rollout, span: _Span, parent_id: int | None, links) -> None:
        ctx = self._SpanContext(rec.trace_id, span.span_id, False, self._flags)
        parent = None if parent_id is None else self._SpanContext(rec.trace_id, parent_id, False, self._flags)
        self._processor.on_end(self._ReadableSpan(
            name=span.name, context=ctx, parent=parent, resource=self.provider.resource, attributes=_clean(span.attributes),
            links=links, kind=self._kinds[span.kind], instrumentation_scope=self._scope,
            status=self._Status(self._StatusCode.ERROR, span.error) if span.error else self._ok,
            start_time=span.start_ns, end_time=span.end_ns))

    # ------------------------------------------------------------------ request / verify
    def child(self, result, name: str, attributes: dict[str, Any] | None = None) -> _Span | None:
        """A child span of the rollout's span (None when the rollout records none)."""
        rec = self._rollouts.get(id(result))
        if rec is None:
            return None
        span = _Span(name, time.time_ns(), attributes or {}, 2 if name == "request" else 0)
        rec.children.append(span)
        return span

    def traceparent(self, result, span: _Span) -> str:
        """The `traceparent` header naming `span` as the parent of what the server does."""
        return f"00-{result.trace_id}-{span.span_id:016x}-01"

    @staticmethod
    def end(span: _Span | None, error: str = "", attributes: dict[str, Any] | None = None) -> None:
        if span is None or span.end_ns:
            return
        span.end_ns = time.time_ns()
        if attributes:
            span.attributes.update(attributes)
        if error:
            span.error = error[:200]

    # ------------------------------------------------------------------ the run
    def close(self, summary=None) -> None:
        """End what is still open and the chunk span, then flush the exporter (bounded)."""
        for key in list(self._rollouts):
            rec = self._rollouts.get(key)
            if rec is not None:
                self._rollouts.pop(key, None)
                rec.root.attributes["rollout.abandoned"] = True
                rec.root.end_ns = time.time_ns()
                self._finish(rec, rec.root, None, self._chunk_link)
        if summary is not None:
            self.chunk.set_attributes(_clean({
                "run.completed": summary.completed, "run.failed": summary.failed, "run.cancelled": summary.cancelled,
                "run.paused": summary.paused, "run.elapsed_s": summary.elapsed_s, "run.fatal_error": summary.fatal_error}))
            if summary.fatal_error:
                self.chunk.set_status(self._Status(self._StatusCode.ERROR, summary.fatal_error[:200]))
        self.chunk.end()
        if self.config.mode == "otlp":
            self.provider.force_flush(FLUSH_TIMEOUT_MS)


def run_tracer(config: TraceConfig | None) -> RunTracer | None:
    """The run's tracer, or None when tracing is off (the engine's only cost then: one `is None` per step)."""
    if config is None or not config.enabled:
        return None
    return RunTracer(config)


def export_job_span(config: TraceConfig, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
                    error: str = "") -> bool:
    """Export the job's own span (ids from job_span_ids(config.job_key)), parent of its chunks' spans. Its span id
    is fixed, so it is built by hand rather than through the tracer (whose ids are random)."""
    if not config.enabled or not config.job_key:
        return False
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    provider = _provider(config)
    trace_hex, span_hex = job_span_ids(config.job_key)
    span = ReadableSpan(
        name="job", context=SpanContext(trace_id=int(trace_hex, 16), span_id=int(span_hex, 16), is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)),
        parent=None, resource=provider.resource, attributes=_clean(dict(attributes or {})), kind=SpanKind.INTERNAL,
        status=Status(StatusCode.ERROR, error[:200]) if error else Status(StatusCode.UNSET),
        start_time=int(start_ns), end_time=int(end_ns))
    processor = provider._active_span_processor  # noqa: SLF001 (the SDK has no public "export this span")
    processor.on_end(span)
    if config.mode == "otlp":
        provider.force_flush(FLUSH_TIMEOUT_MS)
    return True
