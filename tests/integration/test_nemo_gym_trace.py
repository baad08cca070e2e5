"""A tool-calling NeMo Gym agent driven by the product, for real (`ng_run`, nemo-gym 0.4.0: simple_agent on
example_single_tool_call, the simulator as the policy model behind vllm_model): a rollout's trace id on the
simulator's and the agent's side and in the stored rollout, and its trajectory turn by turn in Chromium.

What nemo-gym 0.4.0 does with a trace (read from its source): no server reads or forwards any request header
(`server_utils.request` sends only JSON and cookies), so the `traceparent` header of the product's POST /run stops
at the agent. What it does forward is the request's `metadata`: simple_agent copies the request into each model
call, vllm_model passes `metadata` on in the chat completion it sends the model server and echoes it in the
response it returns. The product sends the rollout's traceparent both ways (workers/nemo_gym/rows.with_trace)."""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest
import requests
from django.core.management import call_command

from controlplane.jobs.models import CollectionJob, Rollout
from tests.fixtures_nemo_gym import TOOL_AGENT
from tests.integration.test_nemo_gym import read_jsonl

pytestmark = [pytest.mark.nemo_gym, pytest.mark.django_db(transaction=True)]

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")
CITIES = ("sf", "paris", "tokyo", "lima")
TOOL = {"name": "get_weather", "type": "function", "strict": True, "description": "",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": ""}},
                       "required": ["city"], "additionalProperties": False}}


def write_tool_tasks(path: Path, cities=CITIES) -> Path:
    """Rows in the shape of example_single_tool_call's own data (a developer prompt, a question, get_weather)."""
    with open(path, "w") as f:
        for i, city in enumerate(cities):
            f.write(json.dumps({"id": f"w{i}", "responses_create_params": {"input": [
                {"role": "developer", "content": "You are a helpful personal assistant."},
                {"role": "user", "content": f"what's it like in {city}"}], "tools": [TOOL]}}) + "\n")
    return path


def collect(ng, inp: Path, out: Path, capsys, *extra) -> str:
    call_command("collect_rollouts", f"+agent_name={TOOL_AGENT}", f"+input_jsonl_fpath={inp}",
                 f"+output_jsonl_fpath={out}", f"+head_server.host={ng.head_host}", f"+head_server.port={ng.head_port}",
                 "+responses_create_params.max_output_tokens=24", *extra)
    return capsys.readouterr().out


def sim_traceparents(ng) -> dict:
    return requests.get(ng.sim.url + "/admin/traceparents", timeout=10).json()


def test_a_rollouts_trace_id_on_the_simulators_and_the_agents_side(nemo_gym_tools, tmp_path, capsys):
    ng = nemo_gym_tools
    before = sim_traceparents(ng)
    out = tmp_path / "o" / "rollouts.jsonl"
    printed = collect(ng, write_tool_tasks(tmp_path / "tasks.jsonl"), out, capsys, "+num_repeats=2")
    assert "8 ok, 0 failed of 8" in printed, printed
    after = sim_traceparents(ng)
    rollouts = list(Rollout.objects.order_by("task_index", "rollout_index"))
    assert len(rollouts) == 8 and len({r.trace_id for r in rollouts}) == 8
    assert all(re.fullmatch(r"[0-9a-f]{32}", r.trace_id) for r in rollouts)

    # the simulator's side: every model call of every rollout carried the rollout's trace id. simple_agent made
    # two per rollout (the get_weather call, then the answer after the tool's result)
    new = after["metadata_traceparents"][len(before["metadata_traceparents"]):]
    assert all(TRACEPARENT.fullmatch(tp) for tp in new), new[:3]
    assert Counter(TRACEPARENT.fullmatch(tp).group(1) for tp in new) == {r.trace_id: 2 for r in rollouts}

    # the agent's side: the response the agent returned carries the traceparent it was given (vllm_model echoes
    # the request's metadata in each response; simple_agent returns the last), with the rollout's trace id
    for r in rollouts:
        got = TRACEPARENT.fullmatch(r.data["response"]["metadata"]["traceparent"])
        assert got and got.group(1) == r.trace_id, r.data["response"]["metadata"]
        # and the stored request is the row's own: the traceparent the product added is not in it
        assert "traceparent" not in (r.data["responses_create_params"].get("metadata") or {})
    rows = read_jsonl(out)
    assert all("traceparent" not in (x["responses_create_params"].get("metadata") or {}) for x in rows)

    # what nemo-gym 0.4.0 does not do: forward the header. No model request reached the simulator with one
    # (the product's POST /run had it; test_agent_trace shows that header on the agent's request)
    assert after["traceparents"][len(before["traceparents"]):] == []

    # the rollout is found by its trace id, in the stored rollouts
    job = CollectionJob.objects.get()
    assert Rollout.objects.get(job=job, trace_id=rollouts[3].trace_id).pk == rollouts[3].pk


@pytest.mark.browser
def test_a_tool_calling_agents_trajectory_turn_by_turn_in_chromium(nemo_gym_tools, tmp_path, capsys,
                                                                    django_user_model, monkeypatch):
    from django.conf import settings
    from django.db import connection
    from playwright.sync_api import sync_playwright

    from tests.dashboard import servers
    from workers.simulator.text import count_tokens

    servers.prepare_browser(monkeypatch)
    django_user_model.objects.create_user(username="tess", password="tess-pw-123")
    printed = collect(nemo_gym_tools, write_tool_tasks(tmp_path / "tasks.jsonl", ("paris", "tokyo")),
                      tmp_path / "o" / "rollouts.jsonl", capsys, "+owner=tess")
    assert "2 ok, 0 failed of 2" in printed, printed
    r = Rollout.objects.order_by("task_index").first()

    # the stored rollout, as the agent returned it: model call 1 asked for get_weather, the resources server
    # answered, model call 2 answered in text; each call's token ids on its last item (return_token_id_information)
    resp = r.data["response"]
    assert [it["type"] for it in resp["output"]] == ["function_call", "function_call_output", "message"]
    call, result, answer = resp["output"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "paris"}
    assert json.loads(result["output"]) == {"city": "paris", "weather_description": "The weather in paris is cold."}
    assert result["call_id"] == call["call_id"]
    text = answer["content"][0]["text"]
    per_call = [(len(it["prompt_token_ids"]), len(it["generation_token_ids"])) for it in (call, answer)]
    assert per_call[0][1] == count_tokens(call["arguments"]) and per_call[1][1] == 24  # max_output_tokens
    assert per_call[1][0] > per_call[0][0]  # the second call's prompt holds the first call and the tool's result
    # the calls add up to what the agent reported for the whole rollout
    assert [sum(x) for x in zip(*per_call)] == [resp["usage"]["input_tokens"], resp["usage"]["output_tokens"]]

    env = servers.child_env(servers.database_url(connection.settings_dict),
                            servers.redis_url_with_db(settings.REDIS_URL, int(os.environ.get("DASHBOARD_TEST_REDIS_DB", "11"))))
    daphne, url = servers.start_daphne(env)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1360, "height": 1400})
                page.goto(url + "/accounts/login/")
                servers.log_in(page, "tess", "tess-pw-123")
                page.goto(url + f"/traces/{r.trace_id}/")  # found by its trace id, as from a tracing backend
                assert page.url.endswith(f"/rollouts/{r.pk}/"), page.url
                assert page.locator(".trace-id").inner_text().strip() == r.trace_id
                section = page.locator("#trajectory")
                assert "(2 model calls)" in section.locator("h2").inner_text()
                turns = section.locator(".turn")
                assert [t.get_attribute("id") for t in turns.all()] == ["turn-1", "turn-2"]  # in order

                first, second = turns.nth(0), turns.nth(1)
                head = first.locator("h3").inner_text()
                assert "finish tool_calls" in head and f"tokens {per_call[0][0]} in / {per_call[0][1]} out" in head
                assert first.locator(".role-tool code").text_content() == "get_weather"  # (shown in capitals by CSS)
                assert first.locator(".tool-args").inner_text() == call["arguments"]
                assert first.locator(".tool-result").inner_text() == result["output"]
                assert first.locator(".role-assistant").count() == 0
                head = second.locator("h3").inner_text()
                assert "finish stop" in head and f"tokens {per_call[1][0]} in / {per_call[1][1]} out" in head
                assert second.locator(".role-assistant pre").inner_text() == text
                assert second.locator(".role-tool").count() == 0
                assert "TTFT" not in section.inner_text()  # not in a 0.4.0 agent's response: not shown
                artifacts = servers.REPO / "test-artifacts"
                artifacts.mkdir(exist_ok=True)
                page.screenshot(path=str(artifacts / "nemo_gym_trajectory.png"), full_page=True)
            finally:
                browser.close()
    finally:
        daphne.stop()
