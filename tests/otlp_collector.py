"""An in-process OTLP/HTTP traces collector: a tiny HTTP server on 127.0.0.1 that decodes each POSTed
ExportTraceServiceRequest (protobuf) and keeps its spans, for tests and benches."""
from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: list[tuple[str, str]]  # (trace id, span id)
    attributes: dict
    status_code: int
    start_ns: int
    end_ns: int
    service: str = ""


@dataclass
class Collector:
    url: str = ""
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None
    kept: list[bytes] = field(default_factory=list)  # bodies not decoded yet (decode="later")

    def by_name(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(self, name: str, count: int = 1, timeout_s: float = 30.0) -> list[Span]:
        """The spans named `name` once `count` of them have arrived (the exporter process sends on its own time:
        a run's end only hands its spans over); what arrived by the deadline otherwise."""
        deadline = time.monotonic() + timeout_s
        while len(found := self.by_name(name)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def decode_kept(self) -> None:
        """Decode the bodies kept (decode="later") into `spans`."""
        with self.lock:
            kept, self.kept = self.kept, []
        spans = [span for body in kept for span in spans_of(body)]
        with self.lock:
            self.spans.extend(spans)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def spans_of(body: bytes) -> list[Span]:
    """The spans of one ExportTraceServiceRequest."""
    spans = []
    req = ExportTraceServiceRequest.FromString(body)
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    links=[(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links],
                    attributes={a.key: _value(a.value) for a in s.attributes}, status_code=s.status.code,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, service=service))
    return spans


def start_collector(decode: bool | str = True) -> Collector:
    """Start the collector on a free port; its traces URL is `collector.url`. decode=False only counts;
    decode="later" keeps the bodies and decodes them in `decode_kept()` (a bench: no decoding on the CPU it measures)."""
    col = Collector()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            spans = spans_of(body) if decode is True else []
            with col.lock:
                col.spans.extend(spans)
                if decode == "later":
                    col.kept.append(body)
                col.requests += 1
                col.bytes += len(body)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    col.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    col.url = f"http://127.0.0.1:{col.server.server_address[1]}/v1/traces"
    threading.Thread(target=col.server.serve_forever, daemon=True, name="otlp-collector").start()
    return col
