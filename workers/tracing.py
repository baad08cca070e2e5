"""OpenTelemetry spans of a run: job -> chunk -> rollout -> request (and verify), exported over OTLP/HTTP.

Off by default. The engine asks `run_tracer(config)` once per run: None when tracing is off (the engine then
only tests `is None` -- nothing of OpenTelemetry is imported or called), else a RunTracer. The worker process
never loads the SDK: spans are plain slots, then plain tuples handed to an exporter subprocess
(workers/tracing_export.py) that builds, encodes and sends them -- the encoding (~0.1 ms of CPU per span) is
off the worker's CPU path.

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
export to `endpoint`, an OTLP/HTTP traces URL such as http://collector:4318/v1/traces, by the exporter process;
flushed at the run's end, bounded). A full queue to the exporter process drops spans and counts them: logged,
and on the chunk span as `tracing.dropped_spans`; collection never waits on the exporter.
The endpoint is the deployment's (a setting), never a user's.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("off", "spans", "otlp")
FLUSH_TIMEOUT_MS = 5000
BATCH_SPANS = 256  # span tuples of finished rollouts handed to the exporter process at once (or every second)

log = logging.getLogger(__name__)


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


class _Span:
    """A span being recorded: plain slots, turned into an SDK ReadableSpan only when its rollout ends."""

    __slots__ = ("name", "span_id", "start_ns", "end_ns", "attributes", "error", "kind")

    def __init__(self, name: str, start_ns: int, attributes: dict[str, Any] | tuple, kind: int = 0):
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
    each; when it ends they become plain tuples (workers.tracing_export.SPAN_FIELDS), handed in batches to the
    exporter process ("otlp"), which builds the SDK spans and encodes and sends them off this process's CPU, or
    dropped ("spans"). Nothing of OpenTelemetry is imported here. Every method is quick and never raises."""

    def __init__(self, config: TraceConfig):
        self.config = config
        self.ratio = float(config.sample_ratio)
        self._exporter = None
        if config.mode == "otlp":
            from workers.tracing_export import exporter

            self._exporter = exporter(config.endpoint, config.headers, config.service_name)
        self._dropped0 = self._exporter.dropped if self._exporter is not None else 0
        if config.job_key:
            job_trace, job_span = job_span_ids(config.job_key)
            self._chunk_trace, self._chunk_parent = int(job_trace, 16), int(job_span, 16)
        else:
            self._chunk_trace, self._chunk_parent = random.getrandbits(128) or 1, 0
        self.chunk = _Span("chunk", time.time_ns(), dict(config.attributes))
        self._chunk_link = ((self._chunk_trace, self.chunk.span_id),)
        self._rollouts: dict[int, _Rollout] = {}  # id(RolloutResult) -> its spans, while it runs
        self._batch: list[tuple] = []
        self._batch_t = time.monotonic()

    # ------------------------------------------------------------------ rollout
    def rollout_start(self, result, waited_s: float = 0.0) -> None:
        """Start the rollout's span (back-dated by the `waited_s` it spent queued); its trace id is
        result.trace_id. A rollout outside the sample ratio records nothing."""
        if self.ratio < 1.0 and not sampled(result.trace_id, self.ratio):
            return
        root = _Span("rollout", time.time_ns() - int(waited_s * 1e9), (result.task_index, result.rollout_index))
        self._rollouts[id(result)] = _Rollout(int(result.trace_id, 16), root)

    def rollout_end(self, result, abandoned: bool = False) -> None:
        rec = self._rollouts.pop(id(result), None)
        if rec is None:
            return
        root = rec.root
        root.end_ns = time.time_ns()
        # a compact record: the values of ROLLOUT_ATTRS, named in the exporter process (no dict per rollout here)
        root.attributes = (
            result.task_index,
            result.rollout_index,
            bool(result.ok),
            result.attempts,
            result.failure_class,
            result.reward,
            result.input_tokens,
            result.output_tokens,
            result.replica,
            result.weight_version,
            result.queue_ms,
            result.ttft_ms,
            result.generation_ms,
            result.verify_ms,
            result.wall_ms,
            True if abandoned else None,
        )
        if not abandoned and not result.ok:
            root.error = (result.error or result.failure_class)[:200]
        self._finish(rec)

    def _finish(self, rec: _Rollout) -> None:
        """The rollout's spans as tuples, into the batch for the exporter (sent every BATCH_ROLLOUTS or second)."""
        root, trace_id = rec.root, rec.trace_id
        batch = self._batch
        batch.append(
            (
                root.name,
                trace_id,
                root.span_id,
                0,
                root.kind,
                root.start_ns,
                root.end_ns,
                root.attributes,
                root.error,
                self._chunk_link,
            )
        )
        for c in rec.children:
            if not c.end_ns:
                c.end_ns = root.end_ns
                c.error = c.error or "unfinished"
            batch.append(
                (c.name, trace_id, c.span_id, root.span_id, c.kind, c.start_ns, c.end_ns, c.attributes, c.error, ())
            )
        if len(batch) >= BATCH_SPANS or time.monotonic() - self._batch_t >= 1.0:
            self._send()

    def _send(self) -> None:
        batch, self._batch, self._batch_t = self._batch, [], time.monotonic()
        if self._exporter is not None and batch:
            self._exporter.send(batch)

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
        """End what is still open and the chunk span, then flush the exporter process (bounded)."""
        for key in list(self._rollouts):
            rec = self._rollouts.pop(key, None)
            if rec is not None:
                rec.root.attributes = (*rec.root.attributes[:2], *(None,) * 13, True)  # ROLLOUT_ATTRS' order
                rec.root.end_ns = time.time_ns()
                self._finish(rec)
        chunk = self.chunk
        if summary is not None:
            chunk.attributes.update(
                {
                    "run.completed": summary.completed,
                    "run.failed": summary.failed,
                    "run.cancelled": summary.cancelled,
                    "run.paused": summary.paused,
                    "run.elapsed_s": summary.elapsed_s,
                    "run.fatal_error": summary.fatal_error,
                }
            )
            if summary.fatal_error:
                chunk.error = summary.fatal_error[:200]
        chunk.end_ns = time.time_ns()
        if self._exporter is not None:
            dropped = self._exporter.dropped - self._dropped0
            if dropped:
                chunk.attributes["tracing.dropped_spans"] = dropped
                log.warning(
                    "tracing: %d spans of this run were dropped (the exporter process's queue was full)", dropped
                )
        self._batch.append(
            (
                chunk.name,
                self._chunk_trace,
                chunk.span_id,
                self._chunk_parent,
                0,
                chunk.start_ns,
                chunk.end_ns,
                chunk.attributes,
                chunk.error,
                (),
            )
        )
        self._send()
        if self._exporter is not None and self._exporter.flush(FLUSH_TIMEOUT_MS / 1000) is None:
            log.warning("tracing: the exporter process did not confirm its flush within %d ms", FLUSH_TIMEOUT_MS)


def run_tracer(config: TraceConfig | None) -> RunTracer | None:
    """The run's tracer, or None when tracing is off (the engine's only cost then: one `is None` per step)."""
    if config is None or not config.enabled:
        return None
    return RunTracer(config)


def export_job_span(
    config: TraceConfig, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None, error: str = ""
) -> bool:
    """Export the job's own span (ids from job_span_ids(config.job_key)), parent of its chunks' spans, through the
    exporter process, and wait (bounded) until it is sent."""
    if config.mode != "otlp" or not config.enabled or not config.job_key:
        return False
    from workers.tracing_export import exporter

    trace_hex, span_hex = job_span_ids(config.job_key)
    exp = exporter(config.endpoint, config.headers, config.service_name)
    sent = exp.send(
        [
            (
                "job",
                int(trace_hex, 16),
                int(span_hex, 16),
                0,
                0,
                int(start_ns),
                int(end_ns),
                dict(attributes or {}),
                error[:200],
                (),
            )
        ]
    )
    return sent and exp.flush(FLUSH_TIMEOUT_MS / 1000) is not None
