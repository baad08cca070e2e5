"""Word-ish tokenization, synthetic text and math answers.

Tokenization: a token is a run of word characters or one other non-space character
(`re.findall(r"\\w+|[^\\w\\s]")`). Chat prompts are counted on a rendered template, the same one
`/tokenize` uses with `messages`, so usage and /tokenize agree.

Generated text is a list of token strings (each one output token, streamed as one delta); the
completion token count is the length of that list.
"""
from __future__ import annotations

import hashlib
import random
import re
import zlib

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

WORDS = (
    "the model reads the question and thinks about each step before it writes an answer so that "
    "every rollout has some text to score while the simulator keeps time like a real server would "
    "under load with queues caches batches tokens latency and throughput measured carefully across "
    "many requests workers and replicas we check the numbers twice then move on to the next task "
    "because careful work pays off in reinforcement learning pipelines that run for days"
).split()

# "What is 17 + 25?", "Compute 3 * 4", "calculate -5 - 7", "what is 6 x 7", "What is $6 \times 7$?",
# "What is \(6 \cdot 7\)?", "what is 6 × 7", "what is 6 · 7"
MATH_RE = re.compile(r"(?:what\s+is|compute|calculate)\s+(?:\$|\\\()?\s*(-?\d{1,18})\s*(\\times|\\cdot|[-+*x×·⋅])\s*"
                     r"(-?\d{1,18})", re.IGNORECASE)


def count_tokens(text: str) -> int:
    return len(_TOKEN_RE.findall(text))


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def token_id(tok: str) -> int:
    return zlib.crc32(tok.encode()) % 50000


def content_text(content) -> str:
    """Message content as text: a string, or a list of parts ({"type": "text"|"input_text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def render_chat(messages) -> str:
    """The simulated chat template (what /tokenize counts for `messages`)."""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise ValueError("each message must be an object with role and content")
        calls = "".join(f" {c['function'].get('name', '')}({c['function'].get('arguments', '')})"
                        for c in (m.get("tool_calls") or []) if isinstance(c, dict) and isinstance(c.get("function"), dict))
        parts.append(f"<|{m.get('role', 'user')}|> {content_text(m.get('content'))}{calls}\n")
    parts.append("<|assistant|>")
    return "".join(parts)


def last_user_text(messages) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return content_text(m.get("content"))
    return ""


def solve(question: str):
    """(A, op, B, answer) for the last arithmetic question in the text, or None."""
    found = None
    for found in MATH_RE.finditer(question):  # noqa: B007 - keeps the last match
        pass
    if found is None:
        return None
    a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
    if op == "+":
        ans = a + b
    elif op == "-":
        ans = a - b
    else:
        op = "*"
        ans = a * b
    return a, op, b, ans


def request_rng(seed: int, key: str, occurrence: int) -> random.Random:
    h = hashlib.blake2b(f"{seed}|{occurrence}|{key}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(h, "little"))


def generate(rng: random.Random, n: int, math_question: str | None, math_accuracy: float) -> tuple[list[str], dict | None]:
    """n output tokens. For an arithmetic question the text ends with '\\boxed{N}', N right with
    probability math_accuracy (else off by 1..10). Returns (tokens, math_info or None)."""
    info = None
    suffix: list[str] = []
    if math_question is not None:
        solved = solve(math_question)
        if solved is not None:
            a, op, b, ans = solved
            correct = rng.random() < math_accuracy
            given = ans if correct else ans + rng.choice((-1, 1)) * rng.randint(1, 10)
            suffix = [" The", " answer", " is", " \\boxed{%d}" % given]
            info = {"expected": ans, "given": given, "correct": correct}
    if len(suffix) >= n:
        toks = suffix[len(suffix) - n:]
    else:
        body = rng.choices(WORDS, k=n - len(suffix))
        toks = [" " + w for w in body]
        toks[0] = body[0].capitalize()
        toks += suffix
    if toks:
        toks[0] = toks[0].lstrip()
    return toks, info


def tool_call(body: dict):
    """(tool name, JSON arguments) the simulated model calls for a chat request offering `tools`, or None: the
    first tool, while no tool result follows the last user message (then the model answers in text). Each
    property the tool's schema requires (all of them when none is required) gets a value: a string the last
    word of the user's message, a number its length, a boolean true."""
    import json

    tools, messages = body.get("tools"), body.get("messages")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none" or not isinstance(messages, list):
        return None
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "tool":
            return None
        if isinstance(m, dict) and m.get("role") == "user":
            break
    tool = tools[0] if isinstance(tools[0], dict) else {}
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return None
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = [k for k in (params.get("required") or []) if k in props] or list(props)
    words = re.findall(r"[A-Za-z]\w*", last_user_text(messages))
    word = words[-1] if words else "x"
    args = {}
    for k in required:
        typ = props[k].get("type") if isinstance(props[k], dict) else None
        args[k] = len(word) if typ in ("integer", "number") else True if typ == "boolean" else word
    return name, json.dumps(args)
