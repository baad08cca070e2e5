"""Endpoints over the API: CRUD with a write-only API key, health and pre-warm actions, ownership."""
from __future__ import annotations

import pytest

from controlplane.endpoints.models import Endpoint

from tests.factories import make_endpoint, service_job

pytestmark = pytest.mark.django_db

SECRET = "sk-very-secret-value-123"


def test_create_never_echoes_api_key(api, alice):
    r = api.post("/api/endpoints/", {"name": "vllm-a", "base_url": "http://127.0.0.1:8000", "model_name": "m",
                                     "api_key": SECRET, "replica_urls": ["http://127.0.0.1:8001"],
                                     "rpm_limit": 600}, format="json")
    assert r.status_code == 201, r.content
    assert SECRET.encode() not in r.content
    body = r.json()
    assert "api_key" not in body and body["has_api_key"] is True and body["owner"] == "alice"
    ep = Endpoint.objects.get(pk=body["id"])
    assert ep.api_key == SECRET and ep.owner == alice and ep.replica_urls == ["http://127.0.0.1:8001"]
    for url in ("/api/endpoints/", f"/api/endpoints/{ep.pk}/"):
        got = api.get(url)
        assert got.status_code == 200 and SECRET.encode() not in got.content and b'"api_key"' not in got.content


def test_update_keeps_or_clears_key(api, alice):
    ep = make_endpoint(alice, api_key=SECRET)
    r = api.patch(f"/api/endpoints/{ep.pk}/", {"model_name": "other", "max_retries": 2}, format="json")
    assert r.status_code == 200 and r.json()["model_name"] == "other" and r.json()["has_api_key"] is True
    ep.refresh_from_db()
    assert ep.api_key == SECRET and ep.max_retries == 2
    r = api.patch(f"/api/endpoints/{ep.pk}/", {"api_key": ""}, format="json")
    assert r.status_code == 200 and r.json()["has_api_key"] is False
    r = api.put(f"/api/endpoints/{ep.pk}/", {"name": "n", "base_url": "http://vllm:8000", "model_name": "m2"}, format="json")
    assert r.status_code == 200 and r.json()["model_name"] == "m2"


@pytest.mark.parametrize("payload,field", [
    ({"name": "x", "base_url": "not a url", "model_name": "m"}, "base_url"),
    ({"name": "x", "base_url": "http://vllm:8000", "model_name": "m", "replica_urls": ["nope"]}, "replica_urls"),
    ({"name": "x", "base_url": "http://vllm:8000", "model_name": "m", "api_flavor": "grpc"}, "api_flavor"),
    ({"name": "x", "base_url": "http://vllm:8000", "model_name": "m", "request_timeout_s": -1}, "request_timeout_s"),
    ({"name": "x", "base_url": "http://vllm:8000"}, "model_name"),
])
def test_create_validation_errors(api, payload, field):
    r = api.post("/api/endpoints/", payload, format="json")
    assert r.status_code == 400 and field in r.json()


def test_other_users_endpoint_is_404(api, bob):
    theirs = make_endpoint(bob)
    for method, url in [("get", f"/api/endpoints/{theirs.pk}/"), ("patch", f"/api/endpoints/{theirs.pk}/"),
                        ("delete", f"/api/endpoints/{theirs.pk}/"), ("post", f"/api/endpoints/{theirs.pk}/health/"),
                        ("post", f"/api/endpoints/{theirs.pk}/prewarm/")]:
        assert getattr(api, method)(url, {}, format="json").status_code == 404, (method, url)
    assert theirs.pk not in [e["id"] for e in api.get("/api/endpoints/").json()["results"]]
    assert Endpoint.objects.filter(pk=theirs.pk).exists()


def test_delete_and_conflict_when_used(api, alice):
    free = make_endpoint(alice)
    assert api.delete(f"/api/endpoints/{free.pk}/").status_code == 204
    job = service_job(alice)
    r = api.delete(f"/api/endpoints/{job.endpoint_id}/")
    assert r.status_code == 409 and "job" in r.json()["detail"]


def test_health_and_prewarm_against_simulator(api, alice, simulator, eager_tasks):
    ep = make_endpoint(alice, base_url=simulator.url, model_name=simulator.model, api_key="")
    r = api.post(f"/api/endpoints/{ep.pk}/health/")
    assert r.status_code == 202, r.content
    assert r.json()["endpoint"] == ep.pk and r.json()["queued"] == "health"
    body = api.get(f"/api/endpoints/{ep.pk}/").json()
    assert body["last_health"]["ok"] is True and body["last_health_at"]
    r = api.post(f"/api/endpoints/{ep.pk}/prewarm/")
    assert r.status_code == 202, r.content
    result = api.get(f"/api/endpoints/{ep.pk}/").json()["last_prewarm"]
    assert result["ok"] is True and result["succeeded"] == result["sent"] > 0


def test_health_of_unreachable_endpoint_is_reported_not_500(api, alice, eager_tasks):
    ep = make_endpoint(alice, base_url="http://127.0.0.1:9", connect_timeout_s=0.5, request_timeout_s=1)
    r = api.post(f"/api/endpoints/{ep.pk}/health/")
    assert r.status_code == 202, r.content
    health = api.get(f"/api/endpoints/{ep.pk}/").json()["last_health"]
    assert health["ok"] is False and health["replicas"][0]["error"]
