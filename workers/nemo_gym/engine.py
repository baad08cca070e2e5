"""Engine runs for NeMo Gym environments, on the built-in engine's machinery (slots, residency, pacing,
control, progress, sink): only what one task does differs.

* `AgentRun` (endpoint flavor `nemo_gym_agent` / `nemo_gym_head`): each (task, repeat) is one
  `POST {agent}/run` whose answer is the verified rollout. Rows are routed by their own `agent_ref` or, when
  they have none, by the endpoint's agent name (EndpointSpec.model). With a head server, the agents are
  found at run start and found again when an agent stops answering (a restarted `ng_run` gives its servers
  new ports). Failures are recorded by class (HTTP status, timeout, connection, the agent's own
  `_ng_failure_class`) after bounded retries with backoff; the run goes on. Each tick carries the split of
  /run time into the model server's (its /metrics, found through the head server's config) and the agent's.
* `RemoteVerifyRun` (verifier `nemo_gym`): the model is driven by the built-in engine and each response is
  scored by a resources server's `POST /verify`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import aiohttp

from workers import outbound
from workers.disclosure import with_detail
from workers.engine.pacing import backoff_delay
from workers.engine.sources import register_flavor, register_verifier
from workers.engine.attempt import Abandon, AttemptError, new_trace_id, traceparent
from workers.engine.runner import CollectionRun
from workers.engine.types import FailureClass, RolloutResult, RunSummary, TaskItem
from workers.telemetry.vllm import VllmScraper

from . import AGENT_FLAVOR, HEAD_FLAVOR, REMOTE_VERIFIER
from .deployment import DeploymentError, resolve
from .rows import FAILURE_CLASS_KEY, NO_PERSIST_KEY, agent_of, output_row, run_body, verify_fields, with_trace

RERESOLVE_MIN_INTERVAL_S = 2.0
VERIFY_MAX_BYTES = 4 * 1024 * 1024  # a /verify answer is one small JSON object
MODEL_SCRAPE_INTERVAL_S = 2.0  # the model server's /metrics, for the agent / model split of /run time


def _number(value):
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _LastTickWaitsForScrape:
    """The run's sink, whose last progress tick (sent once the work is done) waits briefly for the model
    server's final scrape, so a short run still gets its agent / model split."""

    def __init__(self, run: "AgentRun", inner):
        self._run, self._inner = run, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def rollout(self, result):
        await self._inner.rollout(result)

    async def progress(self, tick):
        task = getattr(self._run, "scrape_task", None)
        if self._run.done_event.is_set() and task is not None and not task.done():
            await asyncio.wait({task}, timeout=3.0)
            tick.extra["agent_timing"] = dict(self._run.timing)
        await self._inner.progress(tick)

    async def close(self):
        await self._inner.close()


class AgentRun(CollectionRun):
    ROUTES_REPLICAS = False  # its base URLs are a head server or agents, routed by _urls_for
    VERIFY_OFF_SLOT = False  # the agent verifies inside its /run: one worker per rollout in flight

    def __init__(self, spec, sink, control, verify_pool=None):
        # the agent verifies; its answer is one JSON body (no streaming)
        super().__init__(replace(spec, verifier="none", verify_mode="deferred", stream=False), sink, control, verify_pool)
        self.head = self.base_urls[0] if self.ep.api_flavor == HEAD_FLAVOR else None
        self.default_agent = self.ep.model or None
        self.agent_urls: dict[str | None, list[str]] = {}
        self.resolved_at = 0.0
        self.resolve_lock = asyncio.Lock()
        self.deployment = None
        self.scrape_task = None
        self.sink = _LastTickWaitsForScrape(self, self.sink)
        # Cumulative over the run, sent in every tick as extra["agent_timing"]: /run answers and their time;
        # the model server's requests and seconds (its /metrics e2e histogram) since the run started, and
        # how many /run answers had come back at that scrape (so both sides cover the same span).
        self.timing = {"rollouts": 0, "run_ms": 0.0, "model_requests": 0, "model_ms": 0.0, "rollouts_at_model": 0,
                       "model_scrapes": 0}

    async def _resolve(self, session=None) -> None:
        dep = await resolve(self.head, timeout_s=max(2.0, self.ep.connect_timeout_s), session=session)
        self.agent_urls = {name: [url] for name, url in dep.agents.items()}
        self.deployment = dep
        self.resolved_at = time.monotonic()

    async def _scrape_model_loop(self, upstreams: list[str]) -> None:
        """The model server's time per rollout, from its /metrics: NeMo Gym's agents report no timing of their
        own, so /run time minus model time is the agent's (its work, tools and its /verify call)."""
        scraper = VllmScraper(upstreams, timeout_s=2.0)
        finishing = False
        at_scrape = 0
        try:
            while True:
                res = await scraper.scrape()
                if res.get("unsupported"):
                    return
                e2e = res.get("e2e") or {}
                if res.get("ok") and not res.get("baseline") and e2e.get("count"):
                    self.timing["model_requests"] += int(e2e["count"])
                    self.timing["model_ms"] += float(e2e["count"]) * float(e2e.get("mean") or 0.0) * 1000.0
                if res.get("ok") and not res.get("baseline"):
                    self.timing["rollouts_at_model"] = at_scrape
                    self.timing["model_scrapes"] += 1
                if finishing:
                    return
                try:  # every interval, and once more when the run's work is done (the last tick waits for it)
                    await asyncio.wait_for(self.done_event.wait(), MODEL_SCRAPE_INTERVAL_S)
                    finishing = True
                except asyncio.TimeoutError:
                    pass
                at_scrape = self.timing["rollouts"]
        except asyncio.CancelledError:
            raise
        except Exception:  # timing is a nicety: never fail the run for it
            return
        finally:
            await scraper.close()

    def tick(self):
        tick = super().tick()
        tick.extra["agent_timing"] = dict(self.timing)
        return tick

    async def _reresolve(self) -> None:
        """An agent stopped answering: ask the head server again (throttled; errors leave the old map)."""
        async with self.resolve_lock:
            if time.monotonic() - self.resolved_at < RERESOLVE_MIN_INTERVAL_S:
                return
            self.resolved_at = time.monotonic()
            try:
                await self._resolve(self.session)
            except DeploymentError:
                pass

    async def run(self, tasks) -> RunSummary:
        if self.head is not None:
            try:
                await self._resolve()
            except DeploymentError as exc:
                await self.sink.close()
                await self._end_tracer_early()
                return RunSummary(completed=0, failed=0, cancelled=False, paused=False, elapsed_s=0.0,
                                  fatal_error=str(exc))
            if self.default_agent and self.default_agent not in self.agent_urls:
                await self.sink.close()
                known = ", ".join(sorted(a for a in self.agent_urls if a)) or "none"
                await self._end_tracer_early()
                return RunSummary(completed=0, failed=0, cancelled=False, paused=False, elapsed_s=0.0,
                                  fatal_error=f"the deployment at {self.head} has no agent {self.default_agent!r} "
                                              f"(agents: {known})")
        else:
            self.agent_urls = {None: self.base_urls}
        upstreams = self.deployment.model_upstreams() if self.deployment is not None else []
        self.scrape_task = asyncio.create_task(self._scrape_model_loop(upstreams)) if upstreams else None
        try:
            return await super().run(tasks)
        finally:
            if self.scrape_task is not None:
                self.scrape_task.cancel()
                await asyncio.gather(self.scrape_task, return_exceptions=True)

    async def _end_tracer_early(self) -> None:
        """The run stops before it starts: its chunk span still ends (and is exported)."""
        if self.tracer is not None:
            await self._close_tracer()

    def _urls_for(self, agent: str | None) -> list[str] | None:
        if self.head is None:
            return self.agent_urls[None]
        return self.agent_urls.get(agent)

    async def process_task(self, item: TaskItem, t_enqueued: float):
        body = run_body(item.row, self.default_agent, self.spec.responses_create_params, item.task_index,
                        item.rollout_index, add_seed=self.spec.add_seed)
        result = RolloutResult(task_index=item.task_index, rollout_index=item.rollout_index, ok=False,
                               output_row=body, attempts=0)
        agent = agent_of(body, self.default_agent)
        routable = True
        if self.head is not None and (agent is None or self._urls_for(agent) is None):
            routable = False
            result.failure_class = FailureClass.BAD_INPUT
            known = ", ".join(sorted(a for a in self.agent_urls if a)) or "none"
            result.error = ("the row names no agent (no agent_ref and no agent name on the job)" if agent is None else
                            f"the row routes to agent {agent!r}, which the deployment does not have (agents: {known})")
        if routable and self.rpm is not None:
            await self.rpm.acquire(1)
        t_slot = time.monotonic()
        result.queue_ms = (t_slot - t_enqueued) * 1000.0
        if self.tracer is not None:
            self._trace_rollout(result, t_slot - t_enqueued)
        self._slot_taken(t_slot)
        try:
            answer, unreachable = (await self._run_with_retries(agent, body, result)) if routable else (None, False)
            if answer is not None:
                self.timing["rollouts"] += 1
                self.timing["run_ms"] += (time.monotonic() - t_slot) * 1000.0
                self._take_answer(answer, body, result)
            elif unreachable and self.completed == 0 and self.other_outcomes == 0:
                if not self.fatal_error:
                    self.fatal_error = result.error
                self.stop(cancel=True)
                raise Abandon()
            result.wall_ms = (time.monotonic() - t_slot) * 1000.0
        finally:
            self.in_flight -= 1
        await self.emit(result)

    async def _send(self, url: str, body: dict, result: RolloutResult, parent: str) -> dict:
        """POST /run with the request's `traceparent` both as a header and in the request's metadata, the one
        way it reaches the agent's model calls (rows.with_trace)."""
        return await super()._send(url, with_trace(body, parent), result, parent)

    def _take_answer(self, answer, body: dict, result: RolloutResult) -> None:
        if not isinstance(answer, dict):
            result.failure_class = FailureClass.BAD_RESPONSE
            result.error = f"the agent answered {type(answer).__name__}, not a JSON object"
            return
        out = output_row(answer, body)
        result.output_row = out
        usage = (answer.get("response") or {}).get("usage") if isinstance(answer.get("response"), dict) else None
        if isinstance(usage, dict):
            result.input_tokens = usage.get("input_tokens")
            result.output_tokens = usage.get("output_tokens")
        failure = answer.get(FAILURE_CLASS_KEY) or ("no_persist" if answer.get(NO_PERSIST_KEY) else None)
        if failure:  # `_ng_no_persist` (a kill-shaped failure): failed, and written to no file (jobs.outfiles)
            result.failure_class = f"agent:{failure}"[:40]
            # the agent's own words are its server's text: operators read them, users the class
            result.error = with_detail(f"agent failure {str(failure)[:40]}",
                                       str(answer.get("error") or answer.get("_ng_failure_message") or ""))[:2000]
            return
        result.reward = _number(answer.get("reward"))
        result.ok = True

    async def _run_with_retries(self, agent, body: dict, result: RolloutResult):
        ep = self.ep
        attempt = 0
        while True:
            urls = self._urls_for(agent) or []
            if not urls:
                result.failure_class = FailureClass.BAD_INPUT
                result.error = f"agent {agent!r} is no longer in the deployment"
                return None, False
            url = urls[attempt % len(urls)] + "/run"
            result.attempts = attempt + 1
            try:
                return await self.attempt(url, body, result), False
            except AttemptError as err:
                self.tick_errors[err.failure_class] += 1
                if err.unreachable and self.head is not None:
                    await self._reresolve()
                if not err.retryable or attempt >= ep.max_retries:
                    result.failure_class = err.failure_class
                    retries = f" after {attempt} retr{'y' if attempt == 1 else 'ies'}" if attempt else ""
                    result.error = with_detail(f"cannot reach agent {agent or ''} at {url}: {err}{retries}"
                                               if err.unreachable else f"{err}{retries}", err.detail)
                    return None, err.unreachable
                retry_after = err.retry_after
            delay = backoff_delay(attempt, ep.backoff_base_s, ep.backoff_max_s, retry_after)
            attempt += 1
            try:
                await asyncio.wait_for(self.stop_event.wait(), delay)
            except asyncio.TimeoutError:
                continue
            raise Abandon()


class RemoteVerifyRun(CollectionRun):
    """Generation by the built-in engine; scoring by `POST {resources server}/verify`.

    verifier_options: {"url": "http://host:port"} (a resources server), or {"head_url": ..., "server": name}
    (found through the head server; `server` may be omitted when the deployment has one resources server)."""

    def __init__(self, spec, sink, control, verify_pool=None):
        super().__init__(replace(spec, verifier="none"), sink, control, verify_pool)
        self.spec = spec
        self.verifier = object()  # makes the base run call verify
        self.verify_url: str | None = (spec.verifier_options or {}).get("url")

    async def run(self, tasks) -> RunSummary:
        opts = self.spec.verifier_options or {}
        if not self.verify_url:
            head = opts.get("head_url")
            err = ""
            if not head:
                err = "the nemo_gym verifier needs verifier_options.url (a resources server) or .head_url"
            else:
                try:
                    dep = await resolve(head)
                    servers = dep.by_kind("resources")
                    name = opts.get("server") or (next(iter(servers)) if len(servers) == 1 else None)
                    if name not in servers:
                        err = (f"the deployment at {head} has no resources server {name!r} "
                               f"(resources servers: {', '.join(sorted(servers)) or 'none'})")
                    else:
                        self.verify_url = servers[name].url
                except DeploymentError as exc:
                    err = str(exc)
            if err:
                await self.sink.close()
                return RunSummary(completed=0, failed=0, cancelled=False, paused=False, elapsed_s=0.0, fatal_error=err)
        self.verify_url = self.verify_url.rstrip("/")
        self.verify_timeout = aiohttp.ClientTimeout(total=self.ep.request_timeout_s, sock_connect=self.ep.connect_timeout_s)
        return await super().run(tasks)

    async def verify(self, row: dict, response: dict, result: RolloutResult):
        t0 = time.monotonic()
        body = dict(row)
        # /verify validates a full Responses API object: fields a chat or completions answer has no
        # counterpart for get the API's defaults (the stored response is left as it is)
        body["response"] = {"parallel_tool_calls": True, "tool_choice": "auto", "tools": [], **response}
        url = self.verify_url + "/verify"
        attempt, error, detail, failure = 0, "", "", FailureClass.VERIFIER_ERROR
        while True:
            detail, span = "", None
            try:
                if not result.trace_id:
                    result.trace_id = new_trace_id()
                span = None if self.tracer is None else self.tracer.child(
                    result, "verify", {"url.full": url, "request.attempt": attempt + 1})
                header = traceparent(result.trace_id) if span is None else self.tracer.traceparent(result, span)
                async with self.session.post(url, json=body, timeout=self.verify_timeout, max_bytes=VERIFY_MAX_BYTES,
                                             headers={"traceparent": header}) as resp:
                    text = await resp.read()
                    if resp.status == 200:
                        answer = json.loads(text)
                        reward = _number(answer.get("reward")) if isinstance(answer, dict) else None
                        if reward is None:
                            raise ValueError("the answer has no numeric reward")
                        result.output_row.update(verify_fields(answer))
                        result.output_row["reward"] = reward
                        result.reward = reward
                        result.verify_ms = (time.monotonic() - t0) * 1000.0
                        if span is not None:
                            self.tracer.end(span, "", {"http.response.status_code": 200, "rollout.reward": reward})
                        return
                    error, detail = f"HTTP {resp.status} from {url}", text[:300]
                    retryable = resp.status >= 500 or resp.status in (408, 429)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                _fc, reason, detail, retryable = outbound.describe(exc)  # gate refusals and oversize: not retried
                error = f"{url}: {reason}"
            except (ValueError, TypeError, AttributeError) as exc:
                error, detail, retryable = f"bad answer from {url} ({type(exc).__name__})", str(exc), False
            finally:
                if span is not None:  # not ended above (a no-op if it was): this attempt failed
                    self.tracer.end(span, error or "cancelled")
            if not retryable or attempt >= self.ep.max_retries:
                break
            await asyncio.sleep(backoff_delay(attempt, self.ep.backoff_base_s, self.ep.backoff_max_s))
            attempt += 1
        result.ok = False
        result.failure_class = failure
        result.error = with_detail(f"remote verifier: {error}", detail)[:2000]
        result.reward = 0.0
        result.output_row["reward"] = 0.0
        self.tick_errors[failure] += 1
        result.verify_ms = (time.monotonic() - t0) * 1000.0


# the engine finds these runs through its registry (it never imports this package)
register_flavor(AGENT_FLAVOR, AgentRun)
register_flavor(HEAD_FLAVOR, AgentRun)
register_verifier(REMOTE_VERIFIER, RemoteVerifyRun)
