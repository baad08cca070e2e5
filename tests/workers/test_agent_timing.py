"""Agent jobs' timing split and diagnosis: a NeMo-Gym-shaped deployment (a head server answering
/global_config_dict_yaml and an agent answering POST /run) whose agent calls the real simulator once per /run
and then spends `own_ms` on its own work. The engine splits each /run into the model server's time (its
/metrics) and the agent's, and the diagnosis blames the agent only when the agent holds the time."""
from __future__ import annotations

import asyncio

import aiohttp
import yaml
import pytest
from aiohttp import web

from workers.diagnosis import AGENT, MODEL, diagnose_ticks
from workers.diagnosis.scenarios import rows_math
from workers.engine.materialize import materialize
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, EndpointSpec
from workers.telemetry import Telemetry, TelemetrySink

AGENT_NAME = "slow_agent"


async def start_deployment(sim, own_ms: float):
    """A head server + agent on one port (as ng_run's head and agent servers would answer)."""
    state = {"port": None, "runs": 0}

    async def config(_request):
        cfg = {"policy_api_key": "secret",
               AGENT_NAME: {"responses_api_agents": {"simple_agent": {
                   "host": "127.0.0.1", "port": state["port"],
                   "model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
               "policy_model": {"responses_api_models": {"vllm_model": {
                   "host": "127.0.0.1", "port": 1, "base_url": sim.base_url}}}}
        return web.json_response(yaml.safe_dump(cfg))

    async def run(request):
        body = await request.json()
        rcp = body["responses_create_params"]
        async with aiohttp.ClientSession() as s:  # the agent's one model call
            async with s.post(sim.base_url + "/chat/completions", json={
                    "model": sim.model, "messages": [{"role": "user", "content": rcp["input"][0]["content"]}],
                    "max_tokens": 16}) as resp:
                answer = await resp.json()
        await asyncio.sleep(own_ms / 1000.0)  # the agent's own work (tools, parsing, its /verify call)
        state["runs"] += 1
        usage = answer.get("usage") or {}
        return web.json_response({"responses_create_params": rcp, "reward": 1.0,
                                  "response": {"usage": {"input_tokens": usage.get("prompt_tokens", 0),
                                                         "output_tokens": usage.get("completion_tokens", 0)}}})

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", config)
    app.router.add_post("/run", run)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["port"] = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{state['port']}", state


async def collect_and_diagnose(sim, own_ms: float, n: int = 48, parallelism: int = 8):
    runner, head, state = await start_deployment(sim, own_ms)
    try:
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[head], model=AGENT_NAME, api_flavor="nemo_gym_head",
                                                    request_timeout_s=30, max_retries=1),
                              parallelism=parallelism, progress_interval_s=0.25)
        failures = []

        class Keep:
            async def rollout(self, r):
                if not r.ok:
                    failures.append(r.error)

            async def progress(self, tick):
                pass

            async def close(self):
                pass

        sink = TelemetrySink(Keep(), Telemetry(gpu=False))
        import workers.nemo_gym.engine  # noqa: F401  (registers the agent run)

        summary = await run_collection(spec, materialize(enumerate(rows_math(n)), 1), sink)
    finally:
        await runner.cleanup()
    assert summary.completed == n and state["runs"] == n, (summary, failures[:3])
    ticks = list(sink.history)
    return ticks, diagnose_ticks(ticks, config={"parallelism": parallelism})


def evidence(d) -> dict:
    return {i.name: i.value for i in d.evidence_items}


@pytest.mark.slow
async def test_slow_agent_is_blamed_with_agent_advice(simulator_factory):
    sim = simulator_factory(seed=3, ttft_ms=5, itl_ms=1, jitter=0, output_len_min=8, output_len_max=8)
    ticks, d = await collect_and_diagnose(sim, own_ms=150)
    ev = evidence(d)
    assert d.verdict == AGENT, (d.verdict, d.scores, ev)
    assert ev["agent_model_calls"] == 1.0  # one model request per /run, seen on the model server's /metrics
    assert ev["agent_run_ms_mean"] >= 150 and ev["agent_own_ms_mean"] >= 140
    assert ev["agent_model_ms_mean"] < 0.25 * ev["agent_run_ms_mean"]
    assert d.recommendations[0].setting == "num_workers" and "num_workers" in d.recommendations[0].action
    assert ticks[-1]["extra"]["agent_timing"]["rollouts"] == 48


@pytest.mark.slow
async def test_slow_model_behind_the_agent_is_the_models(simulator_factory):
    sim = simulator_factory(seed=4, ttft_ms=150, itl_ms=2, jitter=0, output_len_min=8, output_len_max=8)
    ticks, d = await collect_and_diagnose(sim, own_ms=0)
    ev = evidence(d)
    assert d.verdict == MODEL, (d.verdict, d.scores, ev)
    assert ev["agent_model_calls"] == 1.0
    assert ev["agent_model_ms_mean"] >= 150 and ev["agent_own_ms_mean"] < 0.5 * ev["agent_model_ms_mean"]
    assert not any(r.setting == "num_workers" for r in d.recommendations)
