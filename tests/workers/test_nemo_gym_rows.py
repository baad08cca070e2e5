"""Rows -> /run bodies and the head server's config, as ng_collect_rollouts reads them (no servers needed)."""
import json

import pytest
import yaml

from workers.nemo_gym.deployment import DeploymentError, parse_config
from workers.nemo_gym.rows import aggregate_entry, output_row, run_body

CONFIG = {
    "head_server": {"host": "127.0.0.1", "port": 11000},
    "policy_api_key": "sk-secret-value",
    "math_with_judge": {"resources_servers": {"math_with_judge": {"entrypoint": "app.py", "host": "127.0.0.1", "port": 4001}}},
    "math_with_judge_simple_agent": {"responses_api_agents": {"simple_agent": {
        "host": "0.0.0.0", "port": 4002, "resources_server": {"type": "resources_servers", "name": "math_with_judge"},
        "model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
    "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": 4003, "api_key": "sk-secret-value",
                                                             "base_url": "${policy_base_url}"}}},
    "policy_base_url": "http://10.9.9.9:8000/v1",
}


def test_head_config_gives_agents_and_drops_secrets():
    body = json.dumps(yaml.safe_dump(CONFIG)).encode()  # what /global_config_dict_yaml answers
    dep = parse_config("http://10.1.2.3:11000", body)
    assert dep.agents == {"math_with_judge_simple_agent": "http://10.1.2.3:4002"}  # 0.0.0.0 -> the head's host
    assert dep.by_kind("resources")["math_with_judge"].url == "http://127.0.0.1:4001"
    assert dep.servers["math_with_judge_simple_agent"].refs == {"resources_server": "math_with_judge",
                                                                "model_server": "policy_model"}
    assert "sk-secret-value" not in json.dumps(dep.public())
    # the model server's own endpoint (an unresolved interpolation followed), for the agent / model time split
    assert dep.model_upstreams() == ["http://10.9.9.9:8000/v1"]


def test_head_config_without_servers_is_a_clear_error():
    with pytest.raises(DeploymentError, match="lists no NeMo Gym servers"):
        parse_config("http://h:1", json.dumps(yaml.safe_dump({"policy_api_key": "x"})))


def test_run_body_matches_ng_collect_rollouts():
    row = {"responses_create_params": {"input": [{"role": "user", "content": "q"}], "temperature": 0.2,
                                       "metadata": {"a": "1"}},
           "expected_answer": "4", "extra": [1, 2]}
    body = run_body(row, "agent_a", {"temperature": 0.7, "metadata": {"b": "2"}}, 3, 1)
    assert body["agent_ref"] == {"name": "agent_a"}
    # shallow merge, as NeMo Gym: the override's metadata replaces the row's
    assert body["responses_create_params"] == {"input": [{"role": "user", "content": "q"}], "temperature": 0.7,
                                               "metadata": {"b": "2"}}
    assert (body["_ng_task_index"], body["_ng_rollout_index"]) == (3, 1)
    assert body["expected_answer"] == "4" and body["extra"] == [1, 2]
    assert row["responses_create_params"]["temperature"] == 0.2 and "agent_ref" not in row  # input untouched
    # a row's own agent_ref wins over the job's agent
    routed = run_body({**row, "agent_ref": {"name": "agent_b"}}, "agent_a", None, 0, 0)
    assert routed["agent_ref"] == {"name": "agent_b"}


def test_output_row_reattaches_indices_and_aggregate_entry_keeps_usage():
    body = run_body({"responses_create_params": {"input": "q"}}, "a", None, 5, 2)
    answer = {"responses_create_params": {"input": "q"}, "response": {"id": "r", "usage": {"output_tokens": 7}},
              "reward": 1.0, "extracted_answer": "4"}
    out = output_row(answer, body)
    assert (out["_ng_task_index"], out["_ng_rollout_index"], out["agent_ref"]) == (5, 2, {"name": "a"})
    entry = aggregate_entry(out)
    assert entry["response"] == {"usage": {"output_tokens": 7}} and "responses_create_params" not in entry
    assert entry["reward"] == 1.0 and entry["extracted_answer"] == "4"


def test_drop_in_arguments_select_the_nemo_gym_deployment():
    from controlplane.jobs.dropin_args import ArgError, parse_overrides

    base = ["+input_jsonl_fpath=in.jsonl", "+output_jsonl_fpath=out.jsonl"]
    cfg = parse_overrides(base + ["+agent_name=my_agent", "+head_server.host=10.0.0.5", "+head_server.port=11001"])
    assert cfg["_nemo_gym"] and cfg["head_server"] == {"host": "10.0.0.5", "port": 11001}
    assert cfg["verifier"] == "none"  # the agent's resources server verifies
    assert parse_overrides(base + ["+agent_name=a"])["head_server"] == {}  # NeMo Gym's defaults apply
    with_model = parse_overrides(base + ["+agent_name=a", "+model_base_url=http://h:1", "+model_name=m"])
    assert not with_model["_nemo_gym"] and with_model["verifier"] == "math"  # the built-in engine, as before
    with pytest.raises(ArgError, match="head_server.hots"):
        parse_overrides(base + ["+agent_name=a", "+head_server.hots=x"])
    with pytest.raises(ArgError, match="port number"):
        parse_overrides(base + ["+agent_name=a", "+head_server.port=abc"])
    with pytest.raises(ArgError, match="missing required"):
        parse_overrides(base)  # neither a model server nor an agent
