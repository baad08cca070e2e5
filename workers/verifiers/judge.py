"""LLM-as-judge: asks another OpenAI-compatible endpoint (chat completions) for a verdict.

Options: `endpoint` (the id of a model endpoint the job's owner may use: its URL, model and API key) or
`base_url` (e.g. http://judge:8000, called without a key), `model`, `api_key_env` (an environment variable of
the worker holding the judge's key: only names the operator lists in JUDGE_API_KEY_ENVS), `prompt_template`
(plain `{field}` substitution only — `response`, `question`, and any top-level row field such as
`expected_answer`; `{{`/`}}` for braces; no format specs, conversions, attributes or indexes), `verdict_regex`
(RE2 syntax, matched in linear time: no backreferences or lookarounds; case-insensitive; its last match is the
verdict: correct/yes/true/pass/1 -> 1.0, incorrect/no/false/fail/0 -> 0.0, a number in [0, 1] -> that score),
`concurrency` (judge calls in flight per run, separate from generation's parallelism), `timeout_s` (per call),
`max_retries` (429, 5xx, timeouts and connection errors; exponential backoff), `max_tokens`. Numeric options are
bounded by the operator's maxima (VERIFIER_OPTION_MAX).
An unparseable verdict is a verifier error on that rollout (reward 0, the judge's text in the error's detail).

Secrets: this module never reads the environment. The control plane resolves `endpoint` / `api_key_env` when a
run starts (controlplane.jobs.verifier_checks.bind_options: the owner's rights and the operator's list checked
again) and hands the key over as `Credentials` under `_credentials`, an option no job can carry (JSON cannot
make one). Every call goes through the outbound gate (allow-list, no redirects, capped answer, deadline).
"""
from __future__ import annotations

import asyncio
import random
import re
import string
from dataclasses import dataclass, field

import aiohttp
import re2

from workers import outbound
from workers.disclosure import with_detail

from .base import Verifier, VerifyResult, register

DEFAULT_TEMPLATE = (
    "You grade answers. Question: {question}\nReference answer: {expected_answer}\nCandidate response: {response}\n"
    "Is the candidate's final answer equivalent to the reference? Reply with exactly one line: "
    "VERDICT: CORRECT or VERDICT: INCORRECT."
)
DEFAULT_VERDICT = r"VERDICT\s*:\s*\**\s*([A-Za-z]+)|\\boxed\{([^{}]*)\}"
_POS = {"correct", "yes", "true", "pass", "1", "right"}
_NEG = {"incorrect", "no", "false", "fail", "0", "wrong"}
ANSWER_MAX_BYTES = 1024 * 1024  # a chat completion of max_tokens tokens: far below this
CREDENTIALS = "_credentials"


@dataclass(frozen=True)
class Credentials:
    """The judge's key, resolved by the control plane at run start (never stored in a job, never printed)."""
    api_key: str = field(repr=False)


class JudgeError(Exception):
    pass


MAX_TEMPLATE_CHARS = 20_000
MAX_TEMPLATE_FIELDS = 64
MAX_REGEX_CHARS = 1_000
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_template(template: str) -> list[tuple[str, str | None]]:
    """[(literal text, field name or None), ...]; ValueError unless every field is a plain `{name}` (a format
    spec such as `{response:>99999999}` would build strings of any size; `{x.attr}` / `{x[0]}` reach into
    objects)."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"prompt_template is longer than {MAX_TEMPLATE_CHARS} characters")
    parts, fields = [], 0
    for literal, name, spec, conversion in string.Formatter().parse(template):
        if name is not None:
            if spec or conversion or not _FIELD_NAME.fullmatch(name):
                shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise ValueError(f"prompt_template field {shown} is not a plain {{name}} (no format specs, "
                                 "conversions, attributes or indexes)")
            fields += 1
        parts.append((literal, name))
    if fields > MAX_TEMPLATE_FIELDS:
        raise ValueError(f"prompt_template names more than {MAX_TEMPLATE_FIELDS} fields")
    return parts


def compile_verdict(pattern: str):
    """The verdict pattern compiled by RE2 (linear time: a user's `(a+)+$` cannot stall a worker);
    ValueError naming what RE2 refuses (backreferences, lookarounds, ...)."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise ValueError(f"verdict_regex is longer than {MAX_REGEX_CHARS} characters")
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"verdict_regex is not a pattern RE2 accepts (linear-time matching: no backreferences "
                         f"or lookarounds): {reason}") from None


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
    """The template with each plain `{field}` replaced by the row's value (str()); nothing else is evaluated."""
    try:
        parts = parse_template(template)
    except ValueError as exc:
        raise JudgeError(f"bad prompt_template: {exc}") from None
    out = []
    for literal, name in parts:
        out.append(literal)
        if name is None:
            continue
        if name == "response":
            value = response_text
        elif name in row:
            value = row[name]
        elif name == "question":
            value = _question(row)
        else:
            raise JudgeError(f"prompt_template names {name!r}, which the row does not have")
        out.append(value if isinstance(value, str) else str(value))
    return "".join(out)


def parse_verdict(text: str, pattern: str) -> float:
    try:
        compiled = compile_verdict(pattern)
    except ValueError as exc:
        raise JudgeError(str(exc)) from None
    matches = list(compiled.finditer(text or ""))
    if not matches:
        raise JudgeError(with_detail("judge verdict unparseable", (text or "")[-200:]))
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
        raise JudgeError(with_detail("judge verdict is neither correct/incorrect nor a score", value)) from None
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
        "base_url": (str, ""), "endpoint": (int, 0), "model": (str, "judge"), "api_key_env": (str, ""),
        "prompt_template": (str, DEFAULT_TEMPLATE), "verdict_regex": (str, DEFAULT_VERDICT),
        "concurrency": (int, 8), "timeout_s": ((int, float), 60.0), "max_retries": (int, 2),
        "max_tokens": (int, 256),
    }
    option_max = {"concurrency": 64, "timeout_s": 300.0, "max_retries": 10, "max_tokens": 8192}
    record_options = frozenset({"endpoint"})  # an endpoint's id: checked against the owner's rights instead

    def __init__(self):
        self._per_loop: dict = {}

    def validate_options(self, options):
        options = dict(options or {}) if isinstance(options, dict) else options
        creds = options.pop(CREDENTIALS, None) if isinstance(options, dict) else None
        if creds is not None and not isinstance(creds, Credentials):
            raise ValueError(f"verifier 'judge': unknown option {CREDENTIALS!r}")
        out = super().validate_options(options)
        if not out["base_url"] and not out["endpoint"]:
            raise ValueError("verifier 'judge': option 'endpoint' (an endpoint id) or 'base_url' is required")
        if out["base_url"] and not out["base_url"].startswith(("http://", "https://")):
            raise ValueError("verifier 'judge': option 'base_url' must be an http:// or https:// URL")
        if creds is not None:
            out[CREDENTIALS] = creds
        if out["concurrency"] < 1:
            raise ValueError("verifier 'judge': concurrency must be >= 1")
        try:
            compile_verdict(out["verdict_regex"])
        except ValueError as exc:
            raise ValueError(f"verifier 'judge': {exc}") from None
        try:
            parse_template(out["prompt_template"])
        except ValueError as exc:
            raise ValueError(f"verifier 'judge': bad prompt_template: {exc}") from None
        return out

    def required(self, options=None):
        """Row fields the template names (beyond response and question)."""
        template = (options or {}).get("prompt_template") or DEFAULT_TEMPLATE
        try:
            names = {name for _, name in parse_template(template) if name}
        except ValueError:
            names = set()  # refused by validate_options
        return tuple(sorted(names - {"response", "question"}))

    def verify(self, row, response_text, options):
        return asyncio.run(self._call(row, response_text, options, own_session=True))

    async def averify(self, row, response_text, options):
        return await self._call(row, response_text, options)

    def _state(self, options):
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None or state[0].closed:
            conc = int(options.get("concurrency") or 8)
            state = (outbound.gated_session(limit=conc, max_bytes=ANSWER_MAX_BYTES), asyncio.Semaphore(conc))
            self._per_loop[loop] = state
        return state

    async def aclose(self):
        """Close this loop's session (the engine calls it when a run ends)."""
        loop = asyncio.get_running_loop()
        state = self._per_loop.pop(loop, None)
        if state is not None:
            await state[0].close()

    async def _call(self, row, response_text, options, own_session=False):
        options = self.clamp_options(options)
        o = {k: options.get(k, d) if options.get(k) is not None else d for k, (_, d) in self.options.items()}
        if not o["base_url"]:
            raise JudgeError("the judge has no URL (option endpoint or base_url)")
        creds = options.get(CREDENTIALS)
        if (o["endpoint"] or o["api_key_env"]) and not isinstance(creds, Credentials):
            # named a key the control plane did not resolve for this run: never look for it here
            raise JudgeError("the judge's credentials were not resolved for this run (endpoint / api_key_env)")
        prompt = render_prompt(o["prompt_template"], row, response_text)
        headers = {}
        if isinstance(creds, Credentials) and creds.api_key:
            headers["Authorization"] = f"Bearer {creds.api_key}"
        body = {"model": o["model"], "messages": [{"role": "user", "content": prompt}],
                "max_tokens": int(o["max_tokens"]), "temperature": 0}
        url = o["base_url"].rstrip("/")
        url = url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")
        timeout = aiohttp.ClientTimeout(total=float(o["timeout_s"]))
        if own_session:
            session, sem = outbound.gated_session(limit=1, max_bytes=ANSWER_MAX_BYTES), asyncio.Semaphore(1)
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
                            if resp.status >= 300:  # a redirect is an answer too: never followed
                                raise JudgeError(with_detail(f"judge answered HTTP {resp.status}",
                                                             (await resp.read())[:200]))
                            data = await resp.json(content_type=None)
                    text = data["choices"][0]["message"]["content"] or ""
                except (outbound.OutboundRefused, outbound.ResponseTooLarge) as exc:
                    raise JudgeError(f"judge not called: {exc.reason}" if isinstance(exc, outbound.OutboundRefused)
                                     else f"judge answer: {exc.reason}") from None
                except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                    last = outbound.describe(exc)[1]
                    continue
                except (KeyError, IndexError, TypeError, ValueError) as exc:
                    raise JudgeError(with_detail(f"bad judge response ({type(exc).__name__})", str(exc))) from None
                score = parse_verdict(text, o["verdict_regex"])
                return VerifyResult(reward=score, fields={"judge_verdict": text[-500:], "judge_attempts": attempt + 1})
            raise JudgeError(f"judge unreachable after {int(o['max_retries']) + 1} attempts: {last}")
        finally:
            if own_session:
                await session.close()
