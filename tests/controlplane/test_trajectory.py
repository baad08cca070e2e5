"""Trajectories (workers/nemo_gym/trajectory.py): a tool-calling agent's rollout turn by turn, in the rollout viewer
and the API. The response here has the shape a NeMo Gym tool-calling agent returns from /run (Responses API
items: reasoning, function_call, function_call_output, message); it is written, not produced by ng_run."""
from __future__ import annotations

import pytest
from django.urls import reverse

from controlplane.jobs.models import Rollout
from tests.factories import api_token, ingest_dataset, make_endpoint, make_job, make_user
from workers.nemo_gym.trajectory import trajectory

AGENT_RESPONSE = {"id": "resp-1", "status": "completed", "usage": {"input_tokens": 300, "output_tokens": 60}, "output": [
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "I should look up the weather."}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "c1", "output": '{"temp_c": 18}'},
    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}',
     "finish_reason": "tool_calls", "usage": {"input_tokens": 120, "output_tokens": 20}},
    {"type": "function_call", "call_id": "c3", "name": "convert", "arguments": {"c": 18}},
    {"type": "function_call_output", "call_id": "c2", "output": '{"temp_c": 24}'},
    {"type": "function_call_output", "call_id": "c3", "output": {"f": 64.4}},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome is warmer (24 C)."}]},
]}


def test_turns_of_a_tool_calling_agent():
    turns = trajectory({"response": AGENT_RESPONSE})
    assert [t["index"] for t in turns] == [1, 2, 3]
    assert turns[0]["reasoning"] == ["I should look up the weather."]
    assert turns[0]["tool_calls"] == [{"call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
                                       "output": '{"temp_c": 18}'}]
    assert [(c["name"], c["output"]) for c in turns[1]["tool_calls"]] == [("get_weather", '{"temp_c": 24}'),
                                                                          ("convert", '{"f": 64.4}')]
    assert turns[1]["tool_calls"][1]["arguments"] == '{"c": 18}'
    assert turns[1]["call"] == {"finish_reason": "tool_calls", "usage": {"input_tokens": 120, "output_tokens": 20}}
    assert turns[2]["messages"] == ["Rome is warmer (24 C)."] and turns[2]["tool_calls"] == []
    # a single answer has no trajectory; nor does a row without a response
    one = {"output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}]}
    assert trajectory({"response": one}) == [] and trajectory({}) == [] and trajectory(None) == []


@pytest.mark.django_db
def test_trajectory_in_the_viewer_and_the_api(client):
    owner = make_user("agent-owner")
    job = make_job(owner, ingest_dataset(owner), make_endpoint(owner), n_rollouts=2)
    r = Rollout.objects.filter(job=job).order_by("id").first()
    r.data = {**r.data, "response": AGENT_RESPONSE}
    r.save(update_fields=["data"])
    client.force_login(owner)
    html = client.get(reverse("dashboard:rollout", args=[r.pk])).content.decode()
    assert 'id="trajectory"' in html and "(3 model calls)" in html
    for n in (1, 2, 3):
        assert f'id="turn-{n}"' in html
    assert "<code>get_weather</code>" in html and "{&quot;temp_c&quot;: 24}" in html and "finish tool_calls" in html
    assert "tokens 120 in / 20 out" in html and "Rome is warmer (24 C)." in html
    other = Rollout.objects.filter(job=job).order_by("id").last()  # a plain answer: no trajectory section
    assert 'id="trajectory"' not in client.get(reverse("dashboard:rollout", args=[other.pk])).content.decode()

    token = api_token(owner)
    rows = client.get(f"/api/jobs/{job.pk}/rollouts/", HTTP_AUTHORIZATION=f"Token {token}").json()["results"]
    by_id = {x["id"]: x for x in rows}
    assert [len(t["tool_calls"]) for t in by_id[r.pk]["trajectory"]] == [1, 2, 0]
    assert by_id[other.pk]["trajectory"] == []
