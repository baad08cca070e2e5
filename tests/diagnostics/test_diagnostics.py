"""Diagnostics in Django: a job run carries telemetry (and the adaptive controller when parallelism is
auto) through the jobs runtime into JobMetricSample.extra; the diagnosis is computed from stored data
(service, management command, API, panel); sweeps are run and stored."""
from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.template.loader import render_to_string
from tests.factories import api_token
from rest_framework.test import APIClient

from controlplane.diagnostics import services
from controlplane.diagnostics.models import ParallelismSweep
from controlplane.jobs import services as job_services
from controlplane.jobs.runtime import run_job_inline
from controlplane.jobs.models import JobMetricSample

pytestmark = pytest.mark.django_db(transaction=True)


def _model_bound_job(user, math_dataset, sim_endpoint, simulator_factory, **kw):
    # 4 sequences at a time, ~0.25 s each, 24 requests in flight: the server is the bottleneck
    sim = simulator_factory(seed=11, ttft_ms=50, itl_ms=8, jitter=0.05, max_num_seqs=4, output_len_min=25,
                            output_len_max=25)
    ds = math_dataset(80, owner=user)
    ep = sim_endpoint(sim.url, owner=user)
    kw.setdefault("num_samples_in_parallel", 24)
    job = job_services.create_job(owner=user, dataset=ds, endpoint=ep, launch=False, verifier="exact",
                                  responses_create_params={"max_output_tokens": 25}, **kw)
    return sim, job


@pytest.mark.slow
def test_job_run_stores_telemetry_and_is_diagnosed(settings, user, math_dataset, sim_endpoint, simulator_factory):
    settings.DIAGNOSTICS_SCRAPE_INTERVAL_S = 0.5
    sim, job = _model_bound_job(user, math_dataset, sim_endpoint, simulator_factory)
    job = run_job_inline(job)
    assert job.state == "completed", job.error_message
    samples = list(JobMetricSample.objects.filter(job=job).order_by("t"))
    assert samples
    tel = [s.extra.get("telemetry") for s in samples]
    assert all(t and t["v"] == 1 for t in tel)
    assert sum(t["timing"]["n"] for t in tel) == 80
    assert any("vllm" in t and t["vllm"]["ok"] for t in tel)
    assert not any("adaptive" in s.extra for s in samples)  # fixed parallelism: no controller

    d = services.diagnose_job(job)
    assert d.verdict == "model_inference_bound", (d.scores, [(i.name, i.value) for i in d.held()])
    assert d.subtype == "server_saturated"
    # the server's 4 slots, measured from /metrics (running while others waited), bound every figure
    assert d.server_slots == 4 and "waited" in d.server_slots_bound
    assert d.recommendations[0].setting == "max_num_seqs"
    assert all(r.value <= 4 for r in d.recommendations if r.setting == "num_samples_in_parallel")
    # outputs all stop at max_output_tokens 25: a truncation warning, never "reduce max_output_tokens"
    assert "truncated_outputs" in {c.name for c in d.conditions}

    out = io.StringIO()
    call_command("diagnose", str(job.pk), "--json", stdout=out)
    payload = json.loads(out.getvalue())
    assert payload["diagnosis"]["verdict"] == "model_inference_bound"
    assert payload["diagnosis"]["recommendations"]
    text = io.StringIO()
    call_command("diagnose", str(job.pk), stdout=text)
    assert "Model inference" in text.getvalue() and "Next steps" in text.getvalue()
    assert "Model server capacity: 4 requests at once" in text.getvalue()


@pytest.mark.slow
def test_parallelism_auto_job_records_adaptive_decisions(user, math_dataset, sim_endpoint, simulator_factory):
    sim = simulator_factory(seed=12, ttft_ms=60, itl_ms=5, jitter=0.05, max_num_seqs=64, output_len_min=20,
                            output_len_max=20)
    ds = math_dataset(400, owner=user)
    ep = sim_endpoint(sim.url, owner=user)
    job = job_services.create_job(owner=user, dataset=ds, endpoint=ep, launch=False, verifier="exact",
                                  num_samples_in_parallel=2, parallelism_auto=True,
                                  responses_create_params={"max_output_tokens": 20})
    job = run_job_inline(job)
    assert job.state == "completed", job.error_message
    samples = list(JobMetricSample.objects.filter(job=job).order_by("t"))
    assert all("adaptive" in s.extra for s in samples)
    decisions = services.adaptive_decisions(job)
    assert decisions and decisions[0]["from"] == 2 and decisions[0]["to"] > 2
    assert all(d["reason"] for d in decisions)
    assert max(s.parallelism for s in samples) > 2  # the engine applied the controller's limit


@pytest.mark.slow
def test_diagnosis_api_and_panel(user, math_dataset, sim_endpoint, simulator_factory, django_user_model, settings):
    settings.ROOT_URLCONF = "tests.diagnostics.urls"
    sim, job = _model_bound_job(user, math_dataset, sim_endpoint, simulator_factory)
    job = run_job_inline(job)
    client = APIClient()
    assert client.get(f"/api/jobs/{job.pk}/diagnosis/").status_code == 401
    client.credentials(HTTP_AUTHORIZATION="Token " + api_token(user))
    r = client.get(f"/api/jobs/{job.pk}/diagnosis/")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["diagnosis"]["verdict"] == "model_inference_bound"
    assert {"name", "value", "threshold", "meaning"} <= set(body["diagnosis"]["evidence_items"][0])
    # another user's job is hidden
    other = django_user_model.objects.create_user(username="other", password="pw")
    c2 = APIClient()
    c2.credentials(HTTP_AUTHORIZATION="Token " + api_token(other))
    assert c2.get(f"/api/jobs/{job.pk}/diagnosis/").status_code == 404
    assert client.get("/api/jobs/999999/diagnosis/").status_code == 404

    # the job page's panel
    from controlplane.panels import JOB_PANELS
    from controlplane.diagnostics.views import panel_context

    assert "diagnosis" in [p.name for p in JOB_PANELS]
    html = render_to_string("diagnostics/panel.html", {"job": job, "panel_ctx": panel_context(None, job)})
    assert 'data-verdict="model_inference_bound"' in html and "max_model_len" in html
    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/")
    assert page.status_code == 200 and b"Bottleneck diagnosis" in page.content


@pytest.mark.slow
def test_sweep_service_command_and_api(settings, user, math_dataset, sim_endpoint, simulator_factory):
    settings.ROOT_URLCONF = "tests.diagnostics.urls"
    sim = simulator_factory(seed=13, ttft_ms=40, itl_ms=5, jitter=0.05, max_num_seqs=8, output_len_min=20,
                            output_len_max=20)
    ds = math_dataset(32, owner=user)
    ep = sim_endpoint(sim.url, owner=user)
    sweep = services.create_sweep(endpoint=ep, dataset=ds, owner=user, sample_size=16, levels=[2, 4, 8, 16, 32],
                                  verifier="exact")
    sweep = services.run_sweep(sweep)
    assert sweep.state == ParallelismSweep.State.COMPLETED, sweep.error_message
    assert [p["parallelism"] for p in sweep.points][:3] == [2, 4, 8]
    assert sweep.recommended in (4, 8, 16)  # capacity 8
    assert sweep.hint in ("model", "mixed") and sweep.interpretation

    out = io.StringIO()
    call_command("sweep", "--endpoint", str(ep.pk), "--dataset", str(ds.pk), "--sample-size", "8", "--levels", "1,2",
                 "--json", stdout=out)
    body = json.loads(out.getvalue())
    assert body["state"] == "completed" and len(body["points"]) == 2

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + api_token(user))
    r = client.get(f"/api/sweeps/{sweep.pk}/")
    assert r.status_code == 200 and r.json()["recommended"] == sweep.recommended
    assert client.post("/api/sweeps/", {"endpoint": ep.pk}, format="json").status_code == 400
    assert client.post("/api/sweeps/", {"endpoint": "x"}, format="json").status_code == 400
    listing = client.get("/api/sweeps/").json()
    assert {s["id"] for s in listing} >= {sweep.pk}


@pytest.mark.slow
def test_sweep_api_post_dispatches_the_celery_task(settings, user, math_dataset, sim_endpoint, simulator_factory,
                                                   monkeypatch):
    settings.ROOT_URLCONF = "tests.diagnostics.urls"
    from controlplane.diagnostics import tasks

    sent = []
    monkeypatch.setattr(tasks.run_sweep_task, "delay", lambda sweep_id: sent.append(sweep_id))
    sim = simulator_factory(seed=14, ttft_ms=20, itl_ms=2, jitter=0, output_len_min=10, output_len_max=10)
    ds = math_dataset(8, owner=user)
    ep = sim_endpoint(sim.url, owner=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + api_token(user))
    r = client.post("/api/sweeps/", {"endpoint": ep.pk, "dataset": ds.pk, "sample_size": 8, "levels": [1, 2]},
                    format="json")
    assert r.status_code == 201, r.content
    assert sent == [r.json()["id"]]
    assert tasks.run_sweep_task(sent[0]) == "completed"  # the task body, run here
    assert client.get(f"/api/sweeps/{sent[0]}/").json()["state"] == "completed"
