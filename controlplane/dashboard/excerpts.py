"""Short excerpts of a rollout for list pages: the last user message and the start of the answer."""
from __future__ import annotations

from workers.engine.convert import response_text

EXCERPT_CHARS = 140


def _clip(text: str, n: int = EXCERPT_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p if isinstance(p, str) else str(p.get("text") or "") for p in content
                        if isinstance(p, (str, dict)))
    return ""


def last_user_message(inp) -> str:
    """The last user message of a row's `responses_create_params.input` (a string input is the message)."""
    if isinstance(inp, str):
        return _clip(inp)
    for item in reversed(inp if isinstance(inp, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            return _clip(_content_text(item.get("content")))
    return ""


def answer_start(response) -> str:
    """The start of the assistant's text in a stored Responses object."""
    if not isinstance(response, dict):
        return ""
    try:
        return _clip(response_text(response))
    except (AttributeError, TypeError):
        return ""


def attach_excerpts(rows, queryset) -> None:
    """Set `prompt_excerpt` and `answer_excerpt` on each row (one query for the page's rows)."""
    ids = [r.id for r in rows]
    found = {pk: (inp, resp) for pk, inp, resp in queryset.filter(pk__in=ids).values_list(
        "id", "data__responses_create_params__input", "data__response")}
    for r in rows:
        inp, resp = found.get(r.id, (None, None))
        r.prompt_excerpt = last_user_message(inp)
        r.answer_excerpt = answer_start(resp)
