"""One attempt at one request to the model server, and what can go wrong with it.

`send_attempt` posts one request through the run's gated session (workers.outbound), reads the answer
(an SSE stream event by event, or one JSON body), converts it to the Responses shape and times it; every
failure becomes an `AttemptError` that names its FailureClass and whether a retry may help, with what the
server said kept apart for operators (`detail`, workers.disclosure). Retries, replica choice and backoff
are the run's (runner.CollectionRun._request_with_retries); this module sends once.

Each rollout gets one W3C trace id (`new_trace_id`) shared by all its requests (model, agent, verifier);
each request carries its own span (`traceparent`).
"""
from __future__ import annotations

import asyncio
import json
import time
from random import getrandbits as _getrandbits

import aiohttp

from workers import outbound

from .convert import StreamAccumulator, convert_answer, decode_sse_events
from .pacing import parse_retry_after
from .types import FailureClass, RolloutResult

WEIGHT_VERSION_HEADERS = ("X-Weight-Version", "X-Model-Weight-Version")
_DRAIN_AFTER_DONE_S = 1.0  # how long a stream's end is awaited after [DONE] to keep its connection


# Ids from the random module, as OpenTelemetry's own id generator makes them: os.urandom lets go of the GIL for
# its system call, and the event loop's thread then waits for it behind the process's other threads (the
# sink's writer, the verifier pool's) -- twice per rollout on the hot path (seen at 4 % of a run's busy samples).
def new_trace_id() -> str:
    """A W3C trace id: 128 random bits as 32 lowercase hex (never all zeros)."""
    return "%032x" % (_getrandbits(128) or 1)


def traceparent(trace_id: str) -> str:
    """`00-<trace id>-<a new span id>-01` (version 00, sampled): the header of one request of the rollout."""
    return "00-%s-%016x-01" % (trace_id, _getrandbits(64) or 1)


class AttemptError(Exception):
    """A failed attempt: the product's words; `detail`: what the server said (operators only)."""

    def __init__(self, failure_class: str, message: str, retryable: bool, retry_after: float | None = None,
                 unreachable: bool = False, detail: str | bytes = ""):
        super().__init__(message)
        self.detail = detail
        self.unreachable = unreachable  # could not even connect (vs. a connection dropped mid-answer)
        self.failure_class = failure_class
        self.retryable = retryable
        self.retry_after = retry_after


class Abandon(Exception):
    """The run is stopping: drop this task without emitting it."""


async def send_attempt(session, url: str, body: dict, result: RolloutResult, *, flavor: str, stream: bool,
                       headers: dict, timeout, connect_timeout_s: float, max_bytes: int | None) -> dict:
    """One request to the model server: the converted answer, or AttemptError saying what failed and whether
    it may be retried. Fills result.trace_id (once per rollout), weight_version, ttft_ms and generation_ms."""
    t_sent = time.monotonic()
    try:
        if not result.trace_id:  # the rollout's, for all its requests (model, agent, verifier)
            result.trace_id = new_trace_id()
        if "traceparent" not in headers:  # W3C: one span per attempt (the run's request span when tracing)
            headers = {**headers, "traceparent": traceparent(result.trace_id)}
        async with session.post(url, json=body, headers=headers, timeout=timeout, max_bytes=max_bytes) as resp:
            status = resp.status
            if status != 200:
                text = (await resp.content.read(4096))[:300]  # for operators only (workers.disclosure)
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
                why = f"HTTP {status} from {url}"
                if status == 429:
                    raise AttemptError(FailureClass.HTTP_429, why, True, retry_after, detail=text)
                if status >= 500:
                    raise AttemptError(FailureClass.HTTP_5XX, why, True, retry_after, detail=text)
                if status == 408:
                    raise AttemptError(FailureClass.TIMEOUT, why, True, retry_after, detail=text)
                raise AttemptError(FailureClass.HTTP_4XX, why, status == 409, retry_after, detail=text)
            for name in WEIGHT_VERSION_HEADERS:
                if name in resp.headers:
                    result.weight_version = resp.headers[name]
                    break
            ctype = resp.headers.get("Content-Type", "")
            if stream and "text/event-stream" in ctype:
                acc = StreamAccumulator(flavor)
                t_first = t_last = None
                buf = b""
                done = False
                async for chunk in resp.content.iter_any():  # capped by the gate (ResponseTooLarge)
                    buf += chunk
                    if b"\n" not in chunk:
                        continue
                    t_chunk = time.monotonic()  # the events of one read arrived together
                    lines = buf.split(b"\n")
                    buf = lines.pop()
                    events = []
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if not data:
                            continue
                        if data == b"[DONE]":
                            done = True
                            break
                        events.append(data)
                    for event in decode_sse_events(events):
                        if acc.feed(event):
                            t_last = t_chunk
                            if t_first is None:
                                t_first = t_chunk
                    if done:
                        break
                if done and not resp.content.at_eof():
                    await drain_after_done(resp)
                if not done and acc.id is None and acc.final is None:
                    raise AttemptError(FailureClass.CONNECTION, f"stream from {url} ended before any data", True)
                response = acc.response()
                now = time.monotonic()
                result.ttft_ms = ((t_first or now) - t_sent) * 1000.0
                result.generation_ms = ((t_last or now) - (t_first or now)) * 1000.0
            else:
                payload = json.loads(await resp.content.read())  # capped by the gate (ResponseTooLarge)
                if isinstance(payload, dict) and payload.get("weight_version") and not result.weight_version:
                    result.weight_version = str(payload["weight_version"])
                response = convert_answer(flavor, payload)
                result.ttft_ms = (time.monotonic() - t_sent) * 1000.0
                result.generation_ms = None
            return response
    except AttemptError:
        raise
    except outbound.OutboundRefused as exc:  # the gate: nothing was sent, and nothing will be
        raise AttemptError(FailureClass.CONNECTION, f"not called: {exc.reason}", False, unreachable=True) from None
    except outbound.ResponseTooLarge as exc:
        raise AttemptError(FailureClass.BAD_RESPONSE, f"response from {url}: {exc.reason}", False) from None
    except aiohttp.ConnectionTimeoutError as exc:
        raise AttemptError(FailureClass.CONNECTION, f"connect timed out after {connect_timeout_s:g}s", True,
                            unreachable=True) from exc
    except aiohttp.ClientConnectorError as exc:
        reason = outbound.describe(exc)[1].removeprefix("cannot connect: ")  # "Connection refused"
        raise AttemptError(FailureClass.CONNECTION, reason, True, unreachable=True) from exc
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        elapsed = time.monotonic() - t_sent
        raise AttemptError(FailureClass.TIMEOUT, f"request to {url} timed out after {elapsed:.1f}s", True) from exc
    except (aiohttp.ClientError, ConnectionError) as exc:
        # a dropped connection, a cut-off body, or an answer that is not HTTP at all (a Redis or SSH banner):
        # one failed attempt, retried like any transport error (the banner is for operators only)
        _fc, reason, detail, _retry = outbound.describe(exc)
        raise AttemptError(FailureClass.CONNECTION, f"{reason} from {url}", True, detail=detail) from exc
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # JSON or shape errors
        raise AttemptError(FailureClass.BAD_RESPONSE, f"bad response from {url}: {type(exc).__name__}", False,
                           detail=str(exc)) from exc


async def drain_after_done(resp) -> None:
    """Read the end of a stream after `[DONE]` (the chunked body's last chunk, which often arrives in a
    later read): a response released before its end closes its connection, and at thousands of requests
    in flight a new TCP connection per request costs more CPU than the request itself. A server that
    keeps the stream open after `[DONE]` only loses the connection, as before."""
    try:
        await asyncio.wait_for(resp.content.read(), _DRAIN_AFTER_DONE_S)
    except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError):
        pass

