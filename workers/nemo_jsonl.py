"""NeMo Gym input JSONL: streaming validation, without a database (the control plane's ingest stores the rows).

A file is read as a stream of byte chunks (a path, any object with `chunks(size)` such as Django's
UploadedFile, or a binary file object), never held whole in memory. sha256 and size are computed as the bytes
pass; each line is decoded and validated (see `validate_row`).

Rules (documented for users):
- Blank lines (empty or only whitespace) are skipped, as NeMo Gym does; they are counted in the report
  (`blank_lines`) but are not bad lines and get no row.
- A UTF-8 byte-order mark at the start of the file is ignored. Lines may end with \\n or \\r\\n.
- Every bad line is reported with its 1-based line number and a reason (the first defect found on that
  line). The stored list is capped at MAX_REPORTED_BAD_LINES; `bad_line_count` is always the true count.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


READ_CHUNK_BYTES = 1 << 20  # 1 MiB
MAX_LINE_BYTES = 64 << 20  # a single line above this is reported as bad without being held whole
MAX_REPORTED_BAD_LINES = 1000
MAX_REASON_CHARS = 300

MESSAGE_ROLES = ("system", "developer", "user", "assistant")
# Responses API input items that are not role messages (multi-turn NeMo Gym data carries them).
NON_MESSAGE_ITEM_TYPES = {
    "function_call", "function_call_output", "reasoning", "item_reference",
    "file_search_call", "web_search_call", "computer_call", "computer_call_output",
    "custom_tool_call", "custom_tool_call_output", "mcp_call", "mcp_list_tools",
}
TEXT_PART_TYPES = {"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"}


@dataclass
class Report:
    bad_lines: list[dict] = field(default_factory=list)
    bad_line_count: int = 0
    blank_lines: int = 0
    total_lines: int = 0
    good_rows: int = 0

    def add_bad(self, line: int, reason: str):
        self.bad_line_count += 1
        if len(self.bad_lines) < MAX_REPORTED_BAD_LINES:
            if len(reason) > MAX_REASON_CHARS:
                reason = reason[: MAX_REASON_CHARS - 1] + "…"
            self.bad_lines.append({"line": line, "reason": reason})

    def as_dict(self, *, accepted_partial: bool, rejected: bool, message: str = "") -> dict:
        return {
            "bad_lines": self.bad_lines,
            "bad_line_count": self.bad_line_count,
            "truncated": self.bad_line_count > len(self.bad_lines),
            "blank_lines": self.blank_lines,
            "total_lines": self.total_lines,
            "good_rows": self.good_rows,
            "accepted_partial": accepted_partial,
            "rejected": rejected,
            "message": message,
        }


def format_report(report: dict, *, max_lines: int | None = None) -> str:
    """Human-readable report: one `line N: reason` per bad line, then a summary line."""
    out = []
    bad = report.get("bad_lines", [])
    shown = bad if max_lines is None else bad[:max_lines]
    for item in shown:
        out.append(f"line {item['line']}: {item['reason']}")
    count = report.get("bad_line_count", len(bad))
    if count > len(shown):
        out.append(f"... and {count - len(shown)} more bad line(s) not listed")
    out.append(
        f"{report.get('good_rows', 0)} good row(s), {count} bad line(s), "
        f"{report.get('blank_lines', 0)} blank line(s) skipped, {report.get('total_lines', 0)} line(s) read"
    )
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# Row validation (pure; reusable by the API for single rows)
# ------------------------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_content(content, where: str) -> str | None:
    if isinstance(content, str):
        return None
    if isinstance(content, list):
        if not content:
            return f"{where}.content is an empty list"
        for j, part in enumerate(content):
            if isinstance(part, str):
                continue
            if not isinstance(part, dict):
                return f"{where}.content[{j}] must be an object with a text part, got {_type_name(part)}"
            ptype = part.get("type")
            if ptype is not None and not isinstance(ptype, str):
                return f"{where}.content[{j}].type must be a string"
            if ptype is None or ptype in TEXT_PART_TYPES:
                if not isinstance(part.get("text"), str):
                    return f"{where}.content[{j}] is a text part without a string 'text'"
        return None
    return f"{where}.content must be a string or a list of parts, got {_type_name(content)}"


def _item(i: int) -> str:
    """Where an input item is, for a message (built only for a bad row: a valid row pays no formatting)."""
    return f"responses_create_params.input[{i}]"


def _check_input(value) -> str | None:
    if value is None:
        return "responses_create_params.input is missing"
    if isinstance(value, str):
        return None if value.strip() else "responses_create_params.input is an empty string"
    if isinstance(value, list):
        if not value:
            return "responses_create_params.input is an empty list"
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                return f"{_item(i)} must be a message object, got {_type_name(item)}"
            itype = item.get("type")
            if itype is not None and not isinstance(itype, str):
                return f"{_item(i)}.type must be a string"
            if itype in NON_MESSAGE_ITEM_TYPES:
                continue
            if itype not in (None, "message"):
                return f"{_item(i)} has unknown type {itype!r}"
            role = item.get("role")
            if role is None:
                return f"{_item(i)} has no 'role'"
            if role not in MESSAGE_ROLES:
                return f"{_item(i)}.role must be one of {'/'.join(MESSAGE_ROLES)}, got {role!r}"
            if "content" not in item:
                return f"{_item(i)} has no 'content'"
            content = item["content"]
            if not isinstance(content, str):
                err = _check_content(content, _item(i))
                if err:
                    return err
        return None
    return f"responses_create_params.input must be a string or a list of messages, got {_type_name(value)}"


_CHECKED_PARAMS = frozenset({
    "temperature", "top_p", "max_output_tokens", "max_tool_calls", "top_logprobs", "tools", "metadata", "reasoning",
    "text", "model", "service_tier", "instructions", "previous_response_id", "truncation", "user",
    "parallel_tool_calls", "store", "stream", "background", "tool_choice"})


def check_optional_params(rcp: dict) -> str | None:
    if rcp.keys().isdisjoint(_CHECKED_PARAMS):  # most rows: the input alone (one set test, not 20 lookups)
        return None
    p = "responses_create_params"
    for key in ("temperature", "top_p"):
        v = rcp.get(key)
        if v is not None and not _is_number(v):
            return f"{p}.{key} must be a number, got {_type_name(v)}"
    t = rcp.get("temperature")
    if t is not None and not (0 <= t <= 2):
        return f"{p}.temperature must be between 0 and 2, got {t}"
    tp = rcp.get("top_p")
    if tp is not None and not (0 <= tp <= 1):
        return f"{p}.top_p must be between 0 and 1, got {tp}"
    for key in ("max_output_tokens", "max_tool_calls"):
        v = rcp.get(key)
        if v is not None and not (_is_int(v) and v > 0):
            return f"{p}.{key} must be a positive integer, got {json.dumps(v)[:40]}"
    v = rcp.get("top_logprobs")
    if v is not None and not (_is_int(v) and v >= 0):
        return f"{p}.top_logprobs must be a non-negative integer, got {json.dumps(v)[:40]}"
    for key in ("tools",):
        v = rcp.get(key)
        if v is not None and not isinstance(v, list):
            return f"{p}.{key} must be an array, got {_type_name(v)}"
    for key in ("metadata", "reasoning", "text"):
        v = rcp.get(key)
        if v is not None and not isinstance(v, dict):
            return f"{p}.{key} must be an object, got {_type_name(v)}"
    for key in ("model", "service_tier", "instructions", "previous_response_id", "truncation", "user"):
        v = rcp.get(key)
        if v is not None and not isinstance(v, str):
            return f"{p}.{key} must be a string, got {_type_name(v)}"
    for key in ("parallel_tool_calls", "store", "stream", "background"):
        v = rcp.get(key)
        if v is not None and not isinstance(v, bool):
            return f"{p}.{key} must be true or false, got {_type_name(v)}"
    tc = rcp.get("tool_choice")
    if tc is not None and not isinstance(tc, (str, dict)):
        return f"{p}.tool_choice must be a string or an object, got {_type_name(tc)}"
    return None


def validate_row(row: Any) -> str | None:
    """Return None when `row` (already parsed JSON) is a valid NeMo Gym input row, else the reason."""
    if not isinstance(row, dict):
        return f"a line must be a JSON object, got {_type_name(row)}"
    if "responses_create_params" not in row:
        return "missing 'responses_create_params'"
    rcp = row["responses_create_params"]
    if not isinstance(rcp, dict):
        return f"'responses_create_params' must be an object, got {_type_name(rcp)}"
    err = _check_input(rcp.get("input"))
    if err:
        return err
    err = check_optional_params(rcp)
    if err:
        return err
    ar = row.get("agent_ref")
    if ar is not None and not isinstance(ar, dict):
        return f"'agent_ref' must be an object, got {_type_name(ar)}"
    ti = row.get("_ng_task_index")
    if "_ng_task_index" in row and not (_is_int(ti) and 0 <= ti < 2**31):
        return "'_ng_task_index' must be an integer from 0 to 2147483647"
    return None


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON (PostgreSQL cannot store it)")


def _parse_float(text):
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:30]} is out of range")
    return value


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _unstorable_char(obj) -> str | None:
    """A string PostgreSQL's jsonb cannot hold: NUL, or a lone UTF-16 surrogate escape."""
    stack = [obj]
    while stack:
        o = stack.pop()
        strings = ()
        if isinstance(o, str):
            strings = (o,)
        elif isinstance(o, dict):
            strings = tuple(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
        for s in strings:
            if "\x00" in s:
                return "contains a NUL character (\\u0000), which cannot be stored"
            if _LONE_SURROGATE.search(s):
                return "contains an unpaired UTF-16 surrogate escape (e.g. \\ud800), which is not valid Unicode"
    return None


# one decoder for every line: json.loads with hooks builds a JSONDecoder per call
_ROW_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_parse_float)


def _parse_line(raw: bytes) -> tuple[dict | None, str, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, "", f"invalid UTF-8 at byte {e.start + 1} of the line ({e.reason})"
    try:
        row = _ROW_DECODER.decode(text)
    except json.JSONDecodeError as e:
        return None, "", f"not valid JSON: {e.msg} at column {e.colno} (char {e.pos})"
    except ValueError as e:  # NaN / Infinity
        return None, "", f"not valid JSON: {e}"
    except RecursionError:
        return None, "", "not valid JSON: nested too deeply"
    err = validate_row(row)
    if err:
        return None, "", err
    if "\\u" in text:
        bad = _unstorable_char(row)
        if bad:
            return None, "", bad
    return row, text, None


# ------------------------------------------------------------------------------------------------
# Streaming
# ------------------------------------------------------------------------------------------------
def iter_chunks(source) -> tuple[Iterator[bytes], callable]:
    """Return (chunk iterator, closer) for a path, a Django UploadedFile/File, or a binary file."""
    if isinstance(source, (str, os.PathLike)):
        fh = open(source, "rb")

        def gen():
            while True:
                b = fh.read(READ_CHUNK_BYTES)
                if not b:
                    return
                yield b

        return gen(), fh.close
    if hasattr(source, "chunks") and callable(source.chunks):  # django.core.files.File / UploadedFile
        try:
            source.seek(0)
        except Exception:
            pass
        return iter(source.chunks(READ_CHUNK_BYTES)), (lambda: None)
    if hasattr(source, "read"):

        def gen():
            while True:
                b = source.read(READ_CHUNK_BYTES)
                if not b:
                    return
                if isinstance(b, str):
                    raise TypeError("ingest_jsonl needs a binary file object (open the file with 'rb')")
                yield b

        return gen(), (lambda: None)
    raise TypeError(f"cannot read a dataset from {type(source).__name__}")


@dataclass
class StreamStats:
    size: int = 0
    sha: Any = field(default_factory=hashlib.sha256)


def _iter_lines(chunks: Iterable[bytes], stats: StreamStats) -> Iterator[tuple[int, bytes | None]]:
    """Yield (1-based line number, line bytes without the newline) — or (n, None) for a line over
    MAX_LINE_BYTES, which is skipped without being held. Hashes and counts every byte."""
    buf = bytearray()
    lineno = 0
    oversized = False
    first = True
    for chunk in chunks:
        stats.size += len(chunk)
        stats.sha.update(chunk)
        if first:
            first = False
            if chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                if not oversized:
                    buf += chunk[start:]
                    if len(buf) > MAX_LINE_BYTES:
                        oversized = True
                        buf = bytearray()
                break
            lineno += 1
            if oversized:
                yield lineno, None
                oversized = False
            else:
                if buf:
                    buf += chunk[start:nl]
                    line = bytes(buf)
                    buf = bytearray()
                else:
                    line = chunk[start:nl]
                if line.endswith(b"\r"):
                    line = line[:-1]
                yield lineno, line
            start = nl + 1
    if oversized:
        yield lineno + 1, None
    elif buf:
        line = bytes(buf)
        if line.endswith(b"\r"):
            line = line[:-1]
        yield lineno + 1, line


def file_sha256(source) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a path or binary file, read in chunks."""
    chunks, close = iter_chunks(source)
    h, size = hashlib.sha256(), 0
    try:
        for c in chunks:
            h.update(c)
            size += len(c)
    finally:
        close()
    return h.hexdigest(), size


def classify_lines(chunks: Iterable[bytes], stats: StreamStats, report: Report):
    """Yield (line number, row, text, None) for each valid line and (line number, None, "", reason) for each
    bad one (an oversized line included); blank lines are only counted. Keeps report.total_lines current;
    good/bad counts are the caller's."""
    for lineno, raw in _iter_lines(chunks, stats):
        report.total_lines = lineno
        if raw is None:
            yield lineno, None, "", f"line is longer than {MAX_LINE_BYTES} bytes"
        elif not raw.strip():
            report.blank_lines += 1
        else:
            yield (lineno, *_parse_line(raw))


def validate_jsonl(fileobj_or_path) -> dict:
    """Validate without storing anything; returns the report (plus sha256 and size_bytes)."""
    report, stats = Report(), StreamStats()
    chunks, close = iter_chunks(fileobj_or_path)
    try:
        for lineno, _row, _text, err in classify_lines(chunks, stats, report):
            if err is None:
                report.good_rows += 1
            else:
                report.add_bad(lineno, err)
    finally:
        close()
    out = report.as_dict(accepted_partial=False, rejected=bool(report.bad_line_count or not report.good_rows))
    out.update(sha256=stats.sha.hexdigest(), size_bytes=stats.size)
    return out
