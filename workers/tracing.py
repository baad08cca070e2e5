"""OpenTelemetry spans of a run: job -> chunk -> rollout -> request (and verify), exported over OTLP/HTTP.

Off by default. The engine asks `run_tracer(config)` once per run: None when tracing is off (the engine then
only tests `is None` -- nothing of OpenTelemetry is imported or called), else a RunTracer. The worker process
never loads the SDK: spans are plain lists, then plain tuples handed to an exporter subprocess
(workers/tracing_export.py) that encodes (workers/otlp_encode.py, ~4 µs of CPU per span) and sends them, off the
worker's CPU path.

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
the run's end waits, bounded, until its spans are in the exporter process's pipe, never for the collector: the
process exports them on its own, also after the worker has exited). A full queue to the exporter process drops
spans and counts them: logged, and on the chunk span as `tracing.dropped_spans`; collection never waits on the
exporter, nor on a slow or dead collector.
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
HANDOVER_TIMEOUT_S = 5.0  # the most a run's end waits for the pipe to the exporter process to take its spans
BATCH_SPANS = 1024  # span tuples of finished rollouts handed to the exporter process at once (or every second)

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
    """The run's chunk span (one per run): plain slots."""

    __slots__ = ("name", "span_id", "start_ns", "end_ns", "attributes", "error", "kind")

    def __init__(self, name: str, start_ns: int, attributes: dict[str, Any], kind: int = 0):
        self.name = name
        self.span_id = _span_id()
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.error = ""
        self.kind = kind


# A rollout being recorded is one list, [trace id, span id, start ns, task index, rollout index, child...]; a child
# span (request, verify) is a list laid out as its finished tuple (SPAN_FIELDS), so that ending the rollout is one
# tuple() per child: [name, trace id, span id, parent id, kind, start ns, end ns (0: open), attributes, error, ()].
# Few objects per rollout, no Python-level constructor calls: the tracer's cost is a few dict and list operations.
_END, _ATTRS, _ERROR = 6, 7, 8  # a child span's slots
_time_ns = time.time_ns
_getrandbits = random.getrandbits


def _span_id() -> int:
    return _getrandbits(64) or 1


def sampled(trace_id: str, ratio: float) -> bool:
    """The W3C "random" trace-id bits (the low 56) against `ratio`: the same answer in every process."""
    if ratio >= 1.0:
        return True
    return ratio > 0.0 and (int(trace_id[-14:], 16) < ratio * (1 << 56))


def _child_span(rec: list, name: str, kind: int, attributes: dict) -> list:
    """A child span of the rollout record `rec` (its final tuple's layout; kind 2: client), started now and kept
    with the rollout."""
    span = [name, rec[0], _getrandbits(64) or 1, rec[1], kind, _time_ns(), 0, attributes, "", ()]
    rec.append(span)
    return span


class RunTracer:
    """The spans of one engine run (one chunk). Cheap by design: while a rollout runs its spans are a list or two
    each; when it ends they become plain tuples (workers.tracing_export.SPAN_FIELDS), handed in batches to the
    exporter process ("otlp"), which encodes (OTLP protobuf) and sends them off this process's CPU, or
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
        self._rollouts: dict[int, list] = {}  # id(RolloutResult) -> its spans (see _END), while it runs
        self._batch: list[tuple] = []
        self._batch_t = time.monotonic()
        # "spans": the span tuples are made, then dropped at once (holding a batch nobody reads only feeds the GC)
        self._keep = self._exporter is not None

    # ------------------------------------------------------------------ rollout
    def rollout_start(self, result, waited_s: float = 0.0) -> None:
        """Start the rollout's span (back-dated by the `waited_s` it spent queued); its trace id is
        result.trace_id. A rollout outside the sample ratio records nothing."""
        if self.ratio < 1.0 and not sampled(result.trace_id, self.ratio):
            return
        self._rollouts[id(result)] = [
            int(result.trace_id, 16),
            _getrandbits(64) or 1,
            _time_ns() - int(waited_s * 1e9),
            result.task_index,
            result.rollout_index,
        ]

    def rollout_end(self, result, abandoned: bool = False) -> None:
        rec = self._rollouts.pop(id(result), None)
        if rec is None:
            return
        # a compact record: the values of ROLLOUT_ATTRS, named in the exporter process (no dict per rollout here)
        ok = bool(result.ok)
        attributes = (
            rec[3],
            rec[4],
            ok,
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
        error = "" if abandoned or ok else (result.error or result.failure_class)[:200]
        self._finish(rec, attributes, error)

    def _finish(self, rec: list, attributes: tuple, error: str) -> None:
        """The rollout's spans as tuples (SPAN_FIELDS), into the batch for the exporter (sent every BATCH_SPANS
        spans or second); dropped at once without an exporter."""
        end_ns = _time_ns()
        spans = [("rollout", rec[0], rec[1], 0, 0, rec[2], end_ns, attributes, error, self._chunk_link)]
        for c in rec[5:]:
            if not c[_END]:
                c[_END] = end_ns
                c[_ERROR] = c[_ERROR] or "unfinished"
            spans.append(tuple(c))
        if self._keep:
            batch = self._batch
            batch += spans
            if len(batch) >= BATCH_SPANS or time.monotonic() - self._batch_t >= 1.0:
                self._send()

    def _send(self) -> None:
        batch, self._batch, self._batch_t = self._batch, [], time.monotonic()
        if self._exporter is not None and batch:
            self._exporter.send(batch)

    # ------------------------------------------------------------------ request / verify
    def child(self, result, name: str, attributes: dict[str, Any] | None = None) -> list | None:
        """A child span of the rollout's span (None when the rollout records none): an opaque handle for
        `traceparent` and `end`."""
        rec = self._rollouts.get(id(result))
        if rec is None:
            return None
        return _child_span(rec, name, 2 if name == "request" else 0, attributes or {})

    def request(self, result, url: str) -> tuple[list | None, str]:
        """The span of one model request of the rollout (a child of its span, attributes `url.full` and
        `request.attempt`) and the `traceparent` header naming it, in one call (the engine's hot path); (None, "")
        when the rollout records none. End it with `request_done` (or `end` when it failed)."""
        rec = self._rollouts.get(id(result))
        if rec is None:
            return None, ""
        span = _child_span(rec, "request", 2, {"url.full": url, "request.attempt": result.attempts})
        return span, f"00-{result.trace_id}-{span[2]:016x}-01"

    @staticmethod
    def request_done(span: list, weight_version: str) -> None:
        """End a request span of `request` that succeeded (`gen_ai.response.weight_version`: the answer's)."""
        if not span[_END]:
            span[_END] = _time_ns()
            span[_ATTRS]["gen_ai.response.weight_version"] = weight_version

    @staticmethod
    def traceparent(result, span: list) -> str:
        """The `traceparent` header naming `span` as the parent of what the server does."""
        return f"00-{result.trace_id}-{span[2]:016x}-01"

    @staticmethod
    def end(span: list | None, error: str = "", attributes: dict[str, Any] | None = None) -> None:
        if span is None or span[_END]:
            return
        span[_END] = _time_ns()
        if attributes:
            span[_ATTRS].update(attributes)
        if error:
            span[_ERROR] = error[:200]

    # ------------------------------------------------------------------ the run
    def close(self, summary=None) -> None:
        """End what is still open and the chunk span, and hand them to the exporter process (bounded wait)."""
        for key in list(self._rollouts):
            rec = self._rollouts.pop(key, None)
            if rec is not None:
                self._finish(rec, (rec[3], rec[4], *(None,) * 13, True), "")  # ROLLOUT_ATTRS' order
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
        if self._exporter is not None and not self._exporter.handed(HANDOVER_TIMEOUT_S):
            log.warning("tracing: the exporter process did not take this run's spans within %g s", HANDOVER_TIMEOUT_S)


def run_tracer(config: TraceConfig | None) -> RunTracer | None:
    """The run's tracer, or None when tracing is off (the engine's only cost then: one `is None` per step)."""
    if config is None or not config.enabled:
        return None
    return RunTracer(config)


def export_job_span(
    config: TraceConfig, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None, error: str = ""
) -> bool:
    """Export the job's own span (ids from job_span_ids(config.job_key)), parent of its chunks' spans, through the
    exporter process: True once the process has it (it sends it on its own time)."""
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
    return sent and exp.handed(HANDOVER_TIMEOUT_S)
