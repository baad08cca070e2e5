"""A weight update on real vLLM on CPU (dev-mode routes) in the middle of a running job, through the API a
trainer calls: pause(keep) -> reload_weights (/collective_rpc) -> set the version -> resume.

vLLM's chat answers carry no weight version, so the control plane numbers the versions it applies and tags
each rollout with the version in force when it was dispatched (from the moment the update's pause was sent).
"""
from __future__ import annotations

import hashlib
import subprocess

import pytest
import requests
from django.db.models import Count
from tests.factories import InlineRun, api_token
from rest_framework.test import APIClient

from controlplane.endpoints.models import AdminOperation, Endpoint, WeightVersion
from controlplane.jobs import services
from controlplane.jobs.models import JobState, Rollout
from tests.fixtures_vllm import MODEL_DIR, VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

PERTURB = """
import shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst, dirs_exist_ok=True)
g = torch.Generator().manual_seed(7)
for f in dst.glob("*.safetensors"):
    t = load_file(f)
    save_file({k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype)).contiguous()
               for k, v in t.items()}, f, metadata={"format": "pt"})
"""


def greedy(url: str, model: str) -> str:
    r = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "What is 17 + 25?"}], "max_tokens": 12,
        "temperature": 0.0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # vLLM's checksum of a parameter with no elements


def checksums(url: str) -> dict:
    r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=120)
    r.raise_for_status()
    return r.json()["checksums"]


def test_update_weights_on_vllm_during_a_running_job(vllm_server, user, math_dataset, tmp_path):
    new_weights = tmp_path / "step-1"
    subprocess.run([str(VLLM_PYTHON), "-c", PERTURB, str(MODEL_DIR.resolve()), str(new_weights)], check=True,
                   timeout=300)
    before = greedy(vllm_server.url, vllm_server.model)
    sums_before = checksums(vllm_server.url)
    ep = Endpoint.objects.create(owner=user, name="vllm-cpu", base_url=vllm_server.url, model_name=vllm_server.model,
                                 request_timeout_s=120)
    parallelism = 4
    job = services.create_job(owner=user, dataset=math_dataset(300), endpoint=ep, launch=False,
                              num_samples_in_parallel=parallelism,
                              responses_create_params={"max_output_tokens": 32, "temperature": 0.0})
    run = InlineRun(job)
    run.wait_for_rows(60, timeout_s=300)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {api_token(user)}")
    # the route queues the update (202) and a worker runs it: here Celery runs inline, as a worker would
    from controlplane.celery import app

    before_eager, app.conf.task_always_eager = app.conf.task_always_eager, True
    try:
        r = api.post(f"/api/endpoints/{ep.pk}/weights/", {"path": str(new_weights), "checkpoint_id": "step-1"},
                     format="json")
    finally:
        app.conf.task_always_eager = before_eager
    assert r.status_code == 202, r.content
    action = api.get(r["Location"]).json()
    assert action["state"] == "succeeded", action
    out = action["result"]
    assert out["server"] == "vllm" and out["applied"] and out["version"] == "1"
    assert [o["kind"] for o in out["operations"]] == ["pause", "update_weights", "set_weight_version", "resume"]
    assert all(o["rpc_ms"] is not None and o["wall_ms"] >= o["rpc_ms"] for o in out["operations"])
    assert AdminOperation.objects.filter(trace_id=out["trace_id"], rpc_source="ttfb").count() == 4
    job = run.join(600)

    # none lost: every rollout of the job is there and succeeded
    assert job.state == JobState.COMPLETED, job.error_message
    assert job.completed_count == 300 == Rollout.objects.filter(job=job, status="ok").count()
    # both versions, split where the update happened in dispatch order (task order within the job); only the
    # requests in flight at the pause (at most `parallelism` of them) may sit on the other side of the split
    by_version = dict(Rollout.objects.filter(job=job).values_list("weight_version").annotate(n=Count("id")))
    assert set(by_version) == {"0", "1"} and by_version["0"] >= 60 - parallelism and by_version["1"] >= 1
    first_new = Rollout.objects.filter(job=job, weight_version="1").order_by("task_index").first().task_index
    late_old = Rollout.objects.filter(job=job, weight_version="0", task_index__gt=first_new).count()
    assert late_old <= parallelism
    assert not Rollout.objects.filter(job=job, weight_version="0",
                                      task_index__gt=first_new + 2 * parallelism).exists()
    # the server took the new weights and reports our version
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=30).json()["weight_version"] == "1"
    assert requests.get(f"{vllm_server.url}/is_paused", timeout=30).json()["is_paused"] is False
    assert greedy(vllm_server.url, vllm_server.model) != before
    sums_after = checksums(vllm_server.url)
    # On a CPU with AVX-512, vLLM packs the linear layers' weights into a kernel-format copy and leaves an empty
    # parameter behind, which the checksum sees as empty before and after; every tensor it can see changed
    assert sums_after.keys() == sums_before.keys()
    visible = [k for k in sums_after if sums_before[k] != EMPTY_DIGEST]
    assert any("embed_tokens" in k for k in visible), visible
    assert all(sums_after[k] != sums_before[k] for k in visible), [k for k in visible if sums_after[k] == sums_before[k]]
    assert WeightVersion.objects.get(endpoint=ep).weights_path == str(new_weights)
    # the job's page and API count rollouts per version, with their lag
    v = api.get(f"/api/jobs/{job.pk}/weight-versions/").json()
    assert {x["version"]: (x["total"], x["lag"]) for x in v["versions"]} == {
        "0": (by_version["0"], 1), "1": (by_version["1"], 0)}
