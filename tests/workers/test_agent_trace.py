"""The trace of an agent rollout: the engine's POST /run to a NeMo-Gym-shaped agent carries the rollout's W3C
`traceparent` (as a header and in the request's metadata), and the rollout handed to the sink has the same trace id."""
from __future__ import annotations

import re

import yaml
from aiohttp import web

from workers.diagnosis.scenarios import rows_math
from workers.engine.materialize import materialize
from workers.engine.runner import run_collection
from workers.engine.types import CollectionSpec, EndpointSpec

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


async def test_an_agents_run_request_carries_the_rollouts_trace(simulator_factory):
    import workers.nemo_gym.engine  # noqa: F401  (registers the agent run)

    sim = simulator_factory(seed=1)
    seen, state = [], {"port": None}

    async def config(_request):
        return web.json_response(yaml.safe_dump({
            "agent": {"responses_api_agents": {"simple_agent": {
                "host": "127.0.0.1", "port": state["port"],
                "model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
            "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": 1,
                                                                     "base_url": sim.base_url}}}}))

    async def run(request):
        body = await request.json()
        seen.append((body.get("_ng_task_index"), request.headers.get("traceparent"),
                     (body["responses_create_params"].get("metadata") or {}).get("traceparent")))
        return web.json_response({"responses_create_params": body["responses_create_params"], "reward": 1.0,
                                  "response": {"usage": {"input_tokens": 3, "output_tokens": 2}}})

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", config)
    app.router.add_post("/run", run)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["port"] = site._server.sockets[0].getsockname()[1]
    results = []

    class Keep:
        async def rollout(self, r):
            results.append(r)

        async def progress(self, tick):
            pass

        async def close(self):
            pass

    try:
        spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[f"http://127.0.0.1:{state['port']}"], model="agent",
                                                    api_flavor="nemo_gym_head", request_timeout_s=30, max_retries=1),
                              parallelism=4, progress_interval_s=0.25)
        summary = await run_collection(spec, materialize(enumerate(rows_math(12)), 1), Keep())
    finally:
        await runner.cleanup()
    assert summary.completed == 12 and len(seen) == 12
    headers = [TRACEPARENT.fullmatch(h or "") for _, h, _ in seen]
    # the same traceparent in the request's metadata (what a NeMo Gym agent passes on to its model calls) ...
    assert all(in_body == h for _, h, in_body in seen)
    # ... and not in the stored row's request, which is the row's own
    assert all("traceparent" not in (r.output_row["responses_create_params"].get("metadata") or {}) for r in results)
    assert all(headers), seen[:3]
    assert sorted(m.group(1) for m in headers) == sorted(r.trace_id for r in results)
    assert len({r.trace_id for r in results}) == 12
