"""The OTLP exporter of workers/tracing.py, off the worker's CPU path: a subprocess (a fresh interpreter that
imports only this module: unlike multiprocessing's spawn it never re-runs the worker's __main__) that encodes
plain span tuples straight into OTLP protobuf (workers/otlp_encode.py, the bytes the SDK's encoder would make)
and sends them in batches with the SDK's OTLPSpanExporter's HTTP client.

The worker side (`Exporter`) only puts lists of span tuples on a bounded queue: `put_nowait`, and a full queue
drops the batch and counts its spans (`stats()["dropped"]`, logged) -- collection never waits on the exporter.
A thread pickles the batches into the process's stdin (length-prefixed frames); acks of flushes come back on
its stdout. The process is started lazily on the first batch, restarted if it died (what it held is lost),
flushed and stopped at the worker process's exit (atexit), and stops by itself when its stdin closes (the
worker is gone): it reads its stdin to the end and exports what it read first, so a run's end only waits until
its spans are in the pipe (`handed`), never for the collector (a dead one cost every run its 5 s flush). Once
the worker is gone the process has DRAIN_AFTER_EXIT_S to send what is left; a dead collector's retries stop then.

A span tuple (SPAN_FIELDS): (name, trace_id, span_id, parent_span_id or 0, kind (0 internal, 2 client),
start_ns, end_ns, attributes, error ("" = ok), links ((trace_id, span_id), ...)); ids are ints. The attributes are
a dict, or a rollout's compact record: a tuple of the values of ROLLOUT_ATTRS, in order (named here, in the
exporter process, so that the worker builds no dict per rollout). None and "" values are left out.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SPAN_FIELDS = ("name", "trace_id", "span_id", "parent_id", "kind", "start_ns", "end_ns", "attributes", "error", "links")
ROLLOUT_ATTRS = (
    "rollout.task_index",
    "rollout.rollout_index",
    "rollout.ok",
    "rollout.attempts",
    "rollout.failure_class",
    "rollout.reward",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "rollout.replica",
    "rollout.weight_version",
    "rollout.queue_ms",
    "rollout.ttft_ms",
    "rollout.generation_ms",
    "rollout.verify_ms",
    "rollout.wall_ms",
    "rollout.abandoned",
)
QUEUE_BATCHES = 64  # batches (1024 spans each at most) waiting for the exporter process; more are dropped and counted
EXPORT_BATCH_SPANS = 2048  # spans per OTLP request (~0.7 MB)
EXPORTER_NICE = 10  # the exporter process's niceness (over the worker's)
EXPORT_DELAY_S = 1.0  # the longest a span waits in the exporter process before its request
EXPORT_TIMEOUT_S = 10.0  # one export request, retries included (the SDK's client)
# Once the worker is gone (stdin closed), what is left is sent within this long; then the retries stop and the rest
# is counted as failed: a dead collector never keeps an exporter process alive for minutes after a command.
DRAIN_AFTER_EXIT_S = 10.0

_exporters: dict[tuple, Exporter] = {}
_lock = threading.Lock()


class Exporter:
    """The worker's handle on one exporter process (per endpoint, headers and service name)."""

    def __init__(self, endpoint: str, headers: dict[str, str], service_name: str):
        self.args = (endpoint, dict(headers), service_name)
        self.dropped = 0  # spans dropped because the queue was full or the process died
        self.sent = 0  # spans handed to the process
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._queue: queue.Queue | None = None
        self._acks: queue.Queue | None = None
        self._pid = os.getpid()
        self._start_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._tokens = itertools.count(1)

    # ------------------------------------------------------------------ worker side
    def _alive(self) -> bool:
        proc = self._proc
        return proc is not None and self._pid == os.getpid() and proc.poll() is None

    def _ensure(self) -> bool:
        """The process, started (or restarted) if needed; False when it cannot be started."""
        if self._alive():
            return True
        with self._start_lock:
            if self._proc is not None and self._pid == os.getpid():
                if self._proc.poll() is None:
                    return True
                self.restarts += 1
                log.warning(
                    "tracing: the OTLP exporter process died (exit code %s); restarting it", self._proc.returncode
                )
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "from workers.tracing_export import _main; _main()"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    start_new_session=True,  # a Ctrl-C of the worker's terminal does not cut the final flush short
                )
                _write(proc.stdin, (os.getpid(), *self.args))
            except Exception:  # noqa: BLE001 (no exporter: spans are dropped and counted, the run goes on)
                log.exception("tracing: cannot start the OTLP exporter process")
                return False
            self._queue, self._acks, self._proc, self._pid = (
                queue.Queue(QUEUE_BATCHES),
                queue.Queue(),
                proc,
                os.getpid(),
            )
            threading.Thread(target=self._feed, args=(proc, self._queue), daemon=True, name="otlp-feed").start()
            threading.Thread(target=_read_acks, args=(proc, self._acks), daemon=True, name="otlp-acks").start()
            return True

    def _feed(self, proc: subprocess.Popen, q: queue.Queue) -> None:
        """Pickle what is queued into the process's stdin (this thread may wait on the pipe; collection never)."""
        while True:
            item = q.get()
            if isinstance(item, threading.Event):  # `handed`: everything queued before it is in the pipe
                item.set()
                continue
            try:
                if item is None:
                    proc.stdin.close()
                    return
                _write(proc.stdin, item)
            except (OSError, ValueError):  # the process is gone: what was queued is lost
                if isinstance(item, list):
                    self.dropped += len(item)
                return

    def send(self, spans: list[tuple]) -> bool:
        """Hand `spans` to the exporter process without waiting: False (and counted) when they are dropped."""
        if not spans:
            return True
        if not self._ensure():
            self.dropped += len(spans)
            return False
        try:
            self._queue.put_nowait(spans)
        except queue.Full:
            self.dropped += len(spans)
            return False
        self.sent += len(spans)
        return True

    def handed(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until what was sent before is written into the process's stdin. From there
        the process exports it on its own time, also after this process has exited; the collector is never waited
        for. False when the process is gone or the pipe did not take it in time."""
        if not self._alive():
            return False
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def flush(self, timeout_s: float) -> dict[str, Any] | None:
        """Wait (at most `timeout_s`) until the process has exported what was sent before; its counters, or None."""
        if not self._alive():
            return None
        deadline = time.monotonic() + timeout_s
        with self._flush_lock:
            token = next(self._tokens)
            try:
                self._queue.put(("flush", token), timeout=max(0.01, deadline - time.monotonic()))
                while True:
                    ack = self._acks.get(timeout=max(0.01, deadline - time.monotonic()))
                    if ack is None:  # the process's stdout closed: it is gone
                        return None
                    if ack[0] == token:
                        return ack[1]
            except (queue.Full, queue.Empty):
                return None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush and stop the process (at exit)."""
        proc = self._proc
        if proc is None or self._pid != os.getpid():
            return
        try:
            if proc.poll() is None:
                self._queue.put(None, timeout=1.0)
                proc.wait(timeout_s)
        except Exception:  # noqa: BLE001
            pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(1.0)
        self._proc = None

    def stats(self) -> dict[str, Any]:
        proc = self._proc
        return {
            "pid": proc.pid if proc is not None else None,
            "sent": self.sent,
            "dropped": self.dropped,
            "restarts": self.restarts,
        }


def exporter(endpoint: str, headers: dict[str, str], service_name: str) -> Exporter:
    """The process-wide exporter for this endpoint (one process each, started on its first batch)."""
    key = (endpoint, tuple(sorted(headers.items())), service_name)
    with _lock:
        exp = _exporters.get(key)
        if exp is None:
            exp = _exporters[key] = Exporter(endpoint, headers, service_name)
        return exp


def stats() -> dict[str, Any]:
    """Counters of every exporter of this process: spans sent, dropped, restarts (and the processes' pids)."""
    with _lock:
        exps = list(_exporters.values())
    out = {"sent": 0, "dropped": 0, "restarts": 0, "pids": []}
    for e in exps:
        s = e.stats()
        out["sent"] += s["sent"]
        out["dropped"] += s["dropped"]
        out["restarts"] += s["restarts"]
        if s["pid"]:
            out["pids"].append(s["pid"])
    return out


@atexit.register
def _stop_all() -> None:
    with _lock:
        exps = list(_exporters.values())
    for e in exps:
        e.stop()
        if e.dropped:
            log.warning("tracing: %d spans were dropped (exporter queue full or process dead)", e.dropped)


def _write(stream, obj) -> None:
    data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def _read(stream):
    """The next frame's object; EOFError at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError
    (n,) = struct.unpack("<I", head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)  # noqa: S301 (frames from our own process, over its own pipe)


def _read_acks(proc: subprocess.Popen, acks: queue.Queue) -> None:
    try:
        while True:
            acks.put(_read(proc.stdout))
    except (EOFError, OSError, ValueError):
        acks.put(None)


def _forget_after_fork() -> None:  # a forked child (a Celery pool process) starts its own exporter
    global _lock
    _lock = threading.Lock()
    _exporters.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------------- the exporter process
def _main() -> None:
    """The exporter process: frames from stdin (the first: parent pid, endpoint, headers, service name), acks of
    flushes to stdout (this process's own prints go to stderr)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    _parent, endpoint, headers, service_name = _read(stdin)
    q: queue.Queue = queue.Queue()
    gone = threading.Event()  # the worker closed our stdin (it stopped us, or exited)

    def pump() -> None:
        try:
            while True:
                q.put(_read(stdin))
        except (EOFError, OSError, ValueError):
            q.put(None)
            gone.set()

    threading.Thread(target=pump, daemon=True, name="otlp-stdin").start()
    _serve(q, lambda ack: _write(out, ack), endpoint, headers, service_name, gone)


def _serve(q, ack, endpoint: str, headers: dict[str, str], service_name: str, gone=None) -> None:
    try:
        os.nice(EXPORTER_NICE)  # the spans yield the CPU to collection: on a busy host they wait, never the rollouts
    except OSError:
        pass
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource

    plog = logging.getLogger(__name__ + ".process")
    otlp = OTLPSpanExporter(endpoint=endpoint, headers=headers or None, timeout=EXPORT_TIMEOUT_S)
    encode_span, encode = _fast_encoder(Resource.create({"service.name": service_name}), "workers.engine")
    counts = {"exported": 0, "failed": 0}
    pending: list = []
    if gone is not None:  # the worker gone, what is left has DRAIN_AFTER_EXIT_S; then retries stop, the rest fails

        def drain_deadline() -> None:
            gone.wait()
            time.sleep(DRAIN_AFTER_EXIT_S)
            otlp.shutdown()

        threading.Thread(target=drain_deadline, daemon=True, name="otlp-drain").start()
    oldest = 0.0

    def export_pending() -> None:
        while pending:
            batch = pending[:EXPORT_BATCH_SPANS]
            del pending[:EXPORT_BATCH_SPANS]
            try:
                ok = _post(otlp, encode(batch))
            except Exception:  # noqa: BLE001
                plog.exception("tracing: OTLP export failed")
                ok = False
            counts["exported" if ok else "failed"] += len(batch)

    running = True
    while running:
        try:
            msg = q.get(timeout=EXPORT_DELAY_S)
        except queue.Empty:
            msg = ()
        if msg is None:
            running = False
        elif isinstance(msg, list):
            if not pending:
                oldest = time.monotonic()
            for t in msg:
                try:
                    pending.append(encode_span(t))
                except Exception:  # noqa: BLE001 (one bad span never stops the exporter)
                    counts["failed"] += 1
        if pending and (
            not running
            or len(pending) >= EXPORT_BATCH_SPANS
            or time.monotonic() - oldest >= EXPORT_DELAY_S
            or (isinstance(msg, tuple) and msg)
        ):
            export_pending()
        if isinstance(msg, tuple) and msg and msg[0] == "flush":
            try:
                ack((msg[1], dict(counts)))
            except (OSError, ValueError):
                pass
    if counts["failed"]:
        plog.warning("tracing: %d spans could not be exported to %s", counts["failed"], endpoint)
    if not otlp._shutdown:  # noqa: SLF001 (the drain timer may have shut it down)
        otlp.shutdown()


def _fast_encoder(resource, scope_name: str):
    """(span tuple -> encoded Span, [encoded Span] -> serialized ExportTraceServiceRequest), by the hand-written
    encoder of workers/otlp_encode.py: the bytes of `_encoder`'s, at a fraction of its CPU."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_resource
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    from workers.otlp_encode import SpanEncoder

    enc = SpanEncoder(
        _encode_resource(resource).SerializeToString(),
        InstrumentationScope(name=scope_name).SerializeToString(),
        ROLLOUT_ATTRS,
    )
    return enc.span, enc.request


def _encoder(resource, scope_name: str):
    """(span tuple -> protobuf Span, [Span] -> serialized ExportTraceServiceRequest): what the SDK's encoder makes
    of a ReadableSpan (the same fields, flags, kinds and status), without building SDK spans first. The reference
    of `_fast_encoder` (the tests compare their bytes)."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_resource, _encode_value
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, SpanFlags, Status

    pb_resource = _encode_resource(resource)
    pb_scope = InstrumentationScope(name=scope_name)
    flags = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK  # parents and links are local (not remote)
    kinds = {0: Span.SPAN_KIND_INTERNAL, 1: Span.SPAN_KIND_SERVER, 2: Span.SPAN_KIND_CLIENT}
    error_code = Status.STATUS_CODE_ERROR

    def value(v) -> AnyValue:
        t = type(v)
        if t is str:
            return AnyValue(string_value=v)
        if t is bool:
            return AnyValue(bool_value=v)
        if t is int:
            return AnyValue(int_value=v)
        if t is float:
            return AnyValue(double_value=v)
        return _encode_value(v)  # sequences (and anything else, as the SDK would)

    def encode_span(t) -> Span:
        name, trace_id, span_id, parent_id, kind, start_ns, end_ns, attributes, error, links = t
        tid = trace_id.to_bytes(16, "big")
        return Span(
            trace_id=tid,
            span_id=span_id.to_bytes(8, "big"),
            parent_span_id=parent_id.to_bytes(8, "big") if parent_id else None,
            name=name,
            kind=kinds.get(kind, Span.SPAN_KIND_INTERNAL),
            start_time_unix_nano=start_ns,
            end_time_unix_nano=end_ns,
            attributes=[
                KeyValue(key=k, value=value(v))
                for k, v in (zip(ROLLOUT_ATTRS, attributes) if type(attributes) is tuple else attributes.items())
                if v is not None and v != ""
            ],
            links=[
                Span.Link(trace_id=lt.to_bytes(16, "big"), span_id=ls.to_bytes(8, "big"), flags=flags)
                for lt, ls in links
            ]
            or None,
            status=Status(code=error_code, message=error) if error else Status(),
            flags=flags,
        )

    def encode(spans: list) -> bytes:
        request = ExportTraceServiceRequest(
            resource_spans=[ResourceSpans(resource=pb_resource, scope_spans=[ScopeSpans(scope=pb_scope, spans=spans)])]
        )
        return request.SerializePartialToString()

    return encode_span, encode


def _post(otlp, data: bytes) -> bool:
    """Send an encoded request with the SDK exporter's own HTTP client (its endpoint, headers, timeout, retries,
    compression and size limit): what OTLPSpanExporter.export does after encoding."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import _is_request_too_large

    if otlp._shutdown:
        return False
    if _is_request_too_large(data, otlp._max_request_size):
        log.warning("tracing: dropping a span batch of %d bytes (over the exporter's max_request_size)", len(data))
        return False
    return bool(otlp._client.export(data).success)
