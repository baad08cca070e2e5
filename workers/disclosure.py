"""What of an error message a user may read: the product's own words, never a server's.

An error about a call out (a model server, an agent, a judge, a health probe) is written as

    <reason> — the server said: <detail>

where `reason` is product-written (a status code, an error class, "cannot connect: Connection refused", the
URL the user gave) and `detail` is whatever the far side sent (a body, a service banner, an exception text
that quotes them). `with_detail()` builds such a message; `public()` cuts it back to the reason. Operators
(staff) read the whole text; everyone else reads `public(text)` (controlplane.access.error_for), so a URL a
user registers never becomes a way to read another service's pages or fingerprint it by its banner.

Texts stored before this convention (no marker) are cut at the usual places a body followed ("HTTP 500 from
URL: <body>", a parser's "Bad status line").
"""
from __future__ import annotations

import re

MARK = " — the server said: "
DETAIL_MAX = 600  # characters of the far side's text kept for operators

_LEGACY = [
    re.compile(r"^(.*?\bHTTP [0-9]{3}\b(?: from \S+?)?)(?=:\s|,\s| -| \().*", re.S),  # "HTTP 500 from http://x: body"
    re.compile(r"^(.*?)\b(?:Bad status line|Invalid (?:method|header|status)|message=).*", re.S),  # parser texts
    re.compile(r"^(.*?\bverdict unparseable)\b.*", re.S),  # the judge's reply
]


def with_detail(reason: str, detail: str | bytes | None = None) -> str:
    """`reason`, plus what the far side said (for operators) when there is any."""
    if isinstance(detail, (bytes, bytearray)):
        detail = bytes(detail[: DETAIL_MAX * 4]).decode("utf-8", "replace")
    detail = (detail or "").strip()
    if not detail:
        return reason
    return f"{reason}{MARK}{detail[:DETAIL_MAX]}"


def public(text: str | None) -> str:
    """The part of an error message anyone may read (see the module docstring)."""
    if not text:
        return text or ""
    text = str(text)
    head, mark, _ = text.partition(MARK)
    if mark:
        return head
    for pattern in _LEGACY:
        m = pattern.match(text)
        if m:
            return m.group(1).rstrip(" :,")
    return text


def public_tree(value):
    """`public()` applied to every string in a JSON-like value (health reports, ops results, ticks)."""
    if isinstance(value, str):
        return public(value)
    if isinstance(value, dict):
        return {k: public_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_tree(v) for v in value]
    return value
