"""Raw JSONL request bodies: handed to the dataset service as a stream, never read whole."""
from __future__ import annotations

from rest_framework import parsers
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer, JSONRenderer

from controlplane.jsonsafe import TooDeep, check_depth


class RawBodyStream:
    """A binary file-like view of the request body. Iterating yields lines (bytes) as they arrive."""

    def __init__(self, stream):
        self._stream = stream
        self.name = ""

    def read(self, size=-1):
        if self._stream is None:
            return b""
        return self._stream.read(size)

    def readline(self, size=-1):
        if self._stream is None:
            return b""
        return self._stream.readline(size)

    def readable(self):
        return True

    def __iter__(self):
        while True:
            line = self.readline()
            if not line:
                return
            yield line


class NDJSONParser(BaseParser):
    """`Content-Type: application/x-ndjson` (also application/jsonl): the body is exposed as
    request.data["file"], a stream, and parsed lazily by whoever reads it."""

    media_type = "application/x-ndjson"

    def parse(self, stream, media_type=None, parser_context=None):
        return {"file": RawBodyStream(stream)}


class JSONLinesParser(NDJSONParser):
    media_type = "application/jsonl"


class NDJSONRenderer(BaseRenderer):
    """For the export route: the body is streamed by the view; this renderer only exists so that
    content negotiation accepts `Accept: application/x-ndjson`, and renders error bodies as JSON."""

    media_type = "application/x-ndjson"
    format = "jsonl"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        return JSONRenderer().render(data) + b"\n"


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser with a bound on nesting: too deep is a 400, never a RecursionError (500)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
        try:
            check_depth(data)
        except TooDeep as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        return data
