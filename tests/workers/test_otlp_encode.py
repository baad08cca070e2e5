"""The hand-written OTLP encoder of the exporter process (workers/otlp_encode.py) makes, byte for byte, what the
protobuf runtime makes of the same spans (tracing_export._encoder), and what the SDK's own encoder makes of the
equivalent ReadableSpans."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: E402
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags  # noqa: E402

from workers.engine.types import FailureClass  # noqa: E402
from workers.otlp_encode import varint  # noqa: E402
from workers.tracing_export import ROLLOUT_ATTRS, _encoder, _fast_encoder  # noqa: E402

RESOURCE = Resource.create({"service.name": "rollout-engine"})
T0 = 1_764_000_000_123_456_789


def spans() -> list[tuple]:
    rollout = (3, 1, True, 2, "", 0.75, 120, 16, "http://127.0.0.1:8000", "v7", 0.5, 1.25, 3.5, 0.0, 5.0, None)
    failed = (4, 0, False, 5, FailureClass.HTTP_5XX, None, None, None, "", "", 0.0, None, None, None, 9.0, True)
    return [
        ("rollout", 0xABCDEF << 64 | 0x1234, 0x55, 0, 0, T0, T0 + 5_000_000, rollout, "", ((0x99 << 80, 0x77),)),
        ("rollout", (1 << 128) - 1, (1 << 64) - 1, 0, 0, T0, T0 + 1, failed, "http_5xx: 503 é", ((1, 2),)),
        (
            "request",
            0xABCDEF << 64 | 0x1234,
            0x56,
            0x55,
            2,
            T0 + 10,
            T0 + 4_000_000,
            {
                "url.full": "http://127.0.0.1:8000/v1/responses",
                "request.attempt": 0,
                "gen_ai.response.weight_version": "",
                "error.type": "timeout",
            },
            "timeout: read",
            (),
        ),
        ("verify", 7, 8, 9, 0, T0, T0, {"verifier.name": "math", "rollout.reward": 1.0}, "", ()),
        (
            "chunk",
            1 << 100,
            3,
            4,
            0,
            T0,
            T0 + 10**12,
            {
                "job.id": 12,
                "run.completed": 3000,
                "run.failed": -1,
                "run.elapsed_s": 12.5,
                "run.paused": False,
                "run.fatal_error": "",
                "big": (1 << 63) - 1,
                "neg": -(1 << 63),
                "list": ["a", "b"],
                "ints": [1, 2],
                "long": "x" * 20000,
                "unicode": "naïve ☃",
                "none": None,
            },
            "e" * 200,
            (),
        ),
        ("job", 5, 6, 0, 1, 0, 0, {}, "", ((1, 1), (2, 2))),
    ]


def test_the_hand_encoder_makes_the_protobuf_runtimes_bytes():
    ref_span, ref_request = _encoder(RESOURCE, "workers.engine")
    fast_span, fast_request = _fast_encoder(RESOURCE, "workers.engine")
    batch = spans()
    for t in batch:
        assert fast_request([fast_span(t)]) == ref_request([ref_span(t)]), t[0]
    assert fast_request([fast_span(t) for t in batch]) == ref_request([ref_span(t) for t in batch])
    assert fast_request([]) == ref_request([])


def test_the_hand_encoder_makes_the_sdk_encoders_bytes():
    """The same spans as SDK ReadableSpans, through the SDK's encode_spans: the same request."""
    scope = InstrumentationScope("workers.engine")
    kinds = {0: SpanKind.INTERNAL, 1: SpanKind.SERVER, 2: SpanKind.CLIENT}

    def ctx(trace_id, span_id):
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    readable = []
    for name, tid, sid, pid, kind, start, end, attrs, error, links in spans()[:4]:
        if type(attrs) is tuple:
            attrs = dict(zip(ROLLOUT_ATTRS, attrs))
        readable.append(
            ReadableSpan(
                name=name,
                context=ctx(tid, sid),
                parent=ctx(tid, pid) if pid else None,
                resource=RESOURCE,
                attributes={k: v for k, v in attrs.items() if v is not None and v != ""},
                links=[Link(ctx(lt, ls)) for lt, ls in links],
                kind=kinds[kind],
                status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
                start_time=start,
                end_time=end,
                instrumentation_scope=scope,
            )
        )
    fast_span, fast_request = _fast_encoder(RESOURCE, "workers.engine")
    assert fast_request([fast_span(t) for t in spans()[:4]]) == encode_spans(readable).SerializePartialToString()


def test_varints():
    from google.protobuf.internal.encoder import _VarintBytes

    for n in (0, 1, 127, 128, 300, 16383, 16384, 1 << 35, (1 << 64) - 1):
        assert varint(n) == _VarintBytes(n)
