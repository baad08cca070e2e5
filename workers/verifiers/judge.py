"""LLM-as-judge: asks another OpenAI-compatible endpoint (chat completions) for a verdict.

Options: `base_url` (required, e.g. http://judge:8000), `model`, `api_key_env` (the name of an
environment variable of the worker holding the judge's key: keys never travel in job options),
`prompt_template` (str.format fields: `response`, `question`, and any top-level row field such as
`expected_answer`), `verdict_regex` (its last match is the verdict: correct/yes/true/pass/1 -> 1.0,
incorrect/no/false/fail/0 -> 0.0, a number in [0, 1] -> that score), `concurrency` (judge calls in
flight per run, separate from generation's parallelism), `timeout_s` (per call), `max_retries`
(429, 5xx, timeouts and connection errors; exponential backoff), `max_tokens`.
An unparseable verdict is a verifier error on that rollout (reward 0, the judge's text in the error).
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import string

import aiohttp

from .base import Verifier, VerifyResult, register

DEFAULT_TEMPLATE = (
    "You grade answers. Question: {question}\nReference answer: {expected_answer}\nCandidate response: {response}\n"
    "Is the candidate's final answer equivalent to the reference? Reply with exactly one line: "
    "VERDICT: CORRECT or VERDICT: INCORRECT."
)
DEFAULT_VERDICT = r"VERDICT\s*:\s*\**\s*([A-Za-z]+)|\\boxed\{([^{}]*)\}"
_POS = {"correct", "yes", "true", "pass", "1", "right"}
_NEG = {"incorrect", "no", "false", "fail", "0", "wrong"}


class JudgeError(Exception):
    pass


class _Fields(dict):
    def __missing__(self, key):
        raise JudgeError(f"prompt_template names {key!r}, which the row does not have")


def _question(row: dict) -> str:
    if row.get("question"):
        return str(row["question"])
    inp = (row.get("responses_create_params") or {}).get("input")
    if isinstance(inp, str):
        return inp
    for msg in reversed(inp or []):
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            return content if isinstance(content, str) else str(content)
    return ""


def render_prompt(template: str, row: dict, response_text: str) -> str:
    fields = _Fields({k: v for k, v in row.items() if isinstance(k, str)})
    fields["response"] = response_text
    fields.setdefault("question", _question(row))
    try:
        return string.Formatter().vformat(template, (), fields)
    except (IndexError, ValueError) as exc:
        raise JudgeError(f"bad prompt_template: {exc}") from None


def parse_verdict(text: str, pattern: str) -> float:
    matches = list(re.finditer(pattern, text or "", re.IGNORECASE))
    if not matches:
        raise JudgeError(f"judge verdict unparseable: {(text or '')[-200:]!r}")
    m = matches[-1]
    value = next((g for g in m.groups() if g is not None), m.group(0)) if m.groups() else m.group(0)
    word = value.strip().strip(".*").lower()
    if word in _POS:
        return 1.0
    if word in _NEG:
        return 0.0
    try:
        score = float(word)
    except ValueError:
        raise JudgeError(f"judge verdict {value!r} is neither correct/incorrect nor a score") from None
    if not 0.0 <= score <= 1.0:
        raise JudgeError(f"judge score {score} is outside [0, 1]")
    return score


@register
class LLMJudge(Verifier):
    """Asks another model endpoint for a verdict (prompt template, verdict parsing, own limits)."""

    name = "judge"
    kind = "remote"
    required_fields = ()
    options = {
        "base_url": (str, ""), "model": (str, "judge"), "api_key_env": (str, ""),
        "prompt_template": (str, DEFAULT_TEMPLATE), "verdict_regex": (str, DEFAULT_VERDICT),
        "concurrency": (int, 8), "timeout_s": ((int, float), 60.0), "max_retries": (int, 2),
        "max_tokens": (int, 256),
    }

    def __init__(self):
        self._per_loop: dict = {}

    def validate_options(self, options):
        out = super().validate_options(options)
        if not out["base_url"].startswith(("http://", "https://")):
            raise ValueError("verifier 'judge': option 'base_url' (http:// or https://) is required")
        if out["concurrency"] < 1:
            raise ValueError("verifier 'judge': concurrency must be >= 1")
        try:
            re.compile(out["verdict_regex"])
        except re.error as exc:
            raise ValueError(f"verifier 'judge': verdict_regex does not compile: {exc}") from None
        try:
            list(string.Formatter().parse(out["prompt_template"]))
        except ValueError as exc:
            raise ValueError(f"verifier 'judge': bad prompt_template: {exc}") from None
        return out

    def required(self, options=None):
        """Row fields the template names (beyond response and question)."""
        template = (options or {}).get("prompt_template") or DEFAULT_TEMPLATE
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f}
        return tuple(sorted({n.split(".")[0].split("[")[0] for n in names} - {"response", "question"}))

    def verify(self, row, response_text, options):
        return asyncio.run(self._call(row, response_text, options, own_session=True))

    async def averify(self, row, response_text, options):
        return await self._call(row, response_text, options)

    def _state(self, options):
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None or state[0].closed:
            conc = int(options.get("concurrency") or 8)
            state = (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)), asyncio.Semaphore(conc))
            self._per_loop[loop] = state
        return state

    async def aclose(self):
        """Close this loop's session (the engine calls it when a run ends)."""
        loop = asyncio.get_running_loop()
        state = self._per_loop.pop(loop, None)
        if state is not None:
            await state[0].close()

    async def _call(self, row, response_text, options, own_session=False):
        o = {k: options.get(k, d) if options.get(k) is not None else d for k, (_, d) in self.options.items()}
        if not o["base_url"]:
            raise JudgeError("option base_url is required")
        prompt = render_prompt(o["prompt_template"], row, response_text)
        headers = {}
        if o["api_key_env"]:
            key = os.environ.get(o["api_key_env"])
            if not key:
                raise JudgeError(f"environment variable {o['api_key_env']} (the judge's API key) is not set")
            headers["Authorization"] = f"Bearer {key}"
        body = {"model": o["model"], "messages": [{"role": "user", "content": prompt}],
                "max_tokens": int(o["max_tokens"]), "temperature": 0}
        url = o["base_url"].rstrip("/")
        url = url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")
        timeout = aiohttp.ClientTimeout(total=float(o["timeout_s"]))
        if own_session:
            session, sem = aiohttp.ClientSession(), asyncio.Semaphore(1)
        else:
            session, sem = self._state(o)
        last = ""
        try:
            for attempt in range(int(o["max_retries"]) + 1):
                if attempt:
                    await asyncio.sleep(min(10.0, 0.2 * 2 ** attempt) * random.uniform(0.5, 1.0))
                try:
                    async with sem:
                        async with session.post(url, json=body, headers=headers, timeout=timeout) as resp:
                            if resp.status == 429 or resp.status >= 500:
                                last = f"HTTP {resp.status}"
                                continue
                            if resp.status >= 400:
                                raise JudgeError(f"judge answered HTTP {resp.status}: {(await resp.text())[:200]}")
                            data = await resp.json(content_type=None)
                    text = data["choices"][0]["message"]["content"] or ""
                except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                    last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    continue
                except (KeyError, IndexError, TypeError, ValueError) as exc:
                    raise JudgeError(f"bad judge response: {type(exc).__name__}: {exc}") from None
                score = parse_verdict(text, o["verdict_regex"])
                return VerifyResult(reward=score, fields={"judge_verdict": text[-500:], "judge_attempts": attempt + 1})
            raise JudgeError(f"judge unreachable after {int(o['max_retries']) + 1} attempts: {last}")
        finally:
            if own_session:
                await session.close()
