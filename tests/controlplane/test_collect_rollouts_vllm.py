"""The collect_rollouts CLI against real vLLM on CPU (tiny local model: its text is gibberish, so the
verifier is `none` / `exact`), checking rows, usage and the NeMo Gym output files; plus endpoint
health against it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.management import call_command

from controlplane.endpoints.models import Endpoint
from controlplane.endpoints.services import check_health, prewarm
from controlplane.jobs.models import CollectionJob, JobState, Rollout

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]


def write_tasks(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": f"Say {i}."}]},
                                "expected_answer": str(i)}) + "\n")
    return path


def test_collect_rollouts_against_vllm_cpu(vllm_server, tmp_path, capsys):
    inp = write_tasks(tmp_path / "tasks.jsonl", 6)
    out = tmp_path / "vllm_rollouts.jsonl"
    args = [f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}", "+num_repeats=2",
            "+num_samples_in_parallel=4", "+responses_create_params.max_output_tokens=8",
            "+responses_create_params.temperature=0.0", f"+model_base_url={vllm_server.url}/v1",
            f"+model_name={vllm_server.model}", "+verifier=exact", "+request_timeout_s=120", "+prewarm=2"]
    call_command("collect_rollouts", *args)
    cap = capsys.readouterr()
    assert "12 ok, 0 failed of 12" in cap.out, cap.out + cap.err
    assert "Pre-warm: 2/2 ok" in cap.err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows) == [(t, k) for t in range(6) for k in range(2)]
    for r in rows:
        usage = r["response"]["usage"]
        assert usage["input_tokens"] > 0 and 1 <= usage["output_tokens"] <= 8
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert r["response"]["output"][0]["type"] == "message"
        assert isinstance(r["response"]["output"][0]["content"][0]["text"], str)
        assert r["reward"] in (0.0, 1.0)
        assert r["responses_create_params"]["max_output_tokens"] == 8
    # greedy decoding: both repeats of a task give the same text
    by_task = {}
    for r in rows:
        by_task.setdefault(r["_ng_task_index"], set()).add(r["response"]["output"][0]["content"][0]["text"])
    assert all(len(texts) == 1 for texts in by_task.values())
    metrics = json.loads((tmp_path / "vllm_rollouts_aggregate_metrics.json").read_text())
    assert metrics["mean/output_tokens"] > 0
    assert (tmp_path / "vllm_rollouts_failures.jsonl").read_text() == ""
    job = CollectionJob.objects.get()
    assert job.state == JobState.COMPLETED
    assert Rollout.objects.filter(job=job, output_tokens__gt=0).count() == 12

    call_command("collect_rollouts", *args)  # rerun: same job, output rewritten, nothing collected again
    assert CollectionJob.objects.count() == 1 and Rollout.objects.count() == 12
    assert len(out.read_text().splitlines()) == 12


def test_endpoint_health_and_prewarm_against_vllm_cpu(vllm_server):
    ep = Endpoint.objects.create(name="vllm-cpu", base_url=vllm_server.url, model_name=vllm_server.model,
                                 request_timeout_s=120)
    res = check_health(ep)
    assert res["ok"] is True, res
    assert res["replicas"][0]["health_status"] == 200 and res["replicas"][0]["models"] == [vllm_server.model]
    assert prewarm(ep, n=2)["succeeded"] == 2
