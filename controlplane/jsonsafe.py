"""JSON from users, parsed with a bound on nesting: a deeply nested document is a clear 400, never a
RecursionError (a 500) here or later where the value is stored, copied or dumped."""
from __future__ import annotations

import json

MAX_JSON_DEPTH = 64


class TooDeep(ValueError):
    pass


def check_depth(obj, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise TooDeep when containers nest deeper than max_depth (iterative: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise TooDeep(f"JSON nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def loads(text, max_depth: int = MAX_JSON_DEPTH, **kw):
    """json.loads that raises ValueError (TooDeep) on nesting beyond max_depth."""
    try:
        obj = json.loads(text, **kw)
    except RecursionError:
        raise TooDeep(f"JSON nested deeper than {max_depth} levels") from None
    check_depth(obj, max_depth)
    return obj
