"""Token auth, anonymous access (401 on every route), the schema and docs pages, JSON 404s, throttling."""
from __future__ import annotations

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

ROUTES = [
    ("get", "/api/datasets/"), ("post", "/api/datasets/"), ("get", "/api/datasets/1/"),
    ("delete", "/api/datasets/1/"), ("get", "/api/datasets/1/rows/"),
    ("get", "/api/endpoints/"), ("post", "/api/endpoints/"), ("get", "/api/endpoints/1/"),
    ("put", "/api/endpoints/1/"), ("patch", "/api/endpoints/1/"), ("delete", "/api/endpoints/1/"),
    ("post", "/api/endpoints/1/health/"), ("post", "/api/endpoints/1/prewarm/"),
    ("get", "/api/jobs/"), ("post", "/api/jobs/"), ("get", "/api/jobs/1/"), ("post", "/api/jobs/1/cancel/"),
    ("post", "/api/jobs/1/pause/"), ("post", "/api/jobs/1/resume/"), ("post", "/api/jobs/1/retry-failed/"),
    ("get", "/api/jobs/1/metrics/"), ("get", "/api/jobs/1/rollouts/"), ("get", "/api/jobs/1/export/"),
]


@pytest.mark.parametrize("method,url", ROUTES)
def test_anonymous_gets_401_everywhere(anon, method, url):
    r = getattr(anon, method)(url)
    assert r.status_code == 401, (method, url, r.status_code)
    assert r["WWW-Authenticate"].startswith("Token")
    assert r.json()["detail"]


def test_bad_token_is_401(anon):
    anon.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert anon.get("/api/jobs/").status_code == 401


def test_obtain_token(anon, alice):
    r = anon.post("/api/auth/token/", {"username": "alice", "password": "pw-alice"}, format="json")
    assert r.status_code == 200 and r.json()["token"] == alice.auth_token.key
    r = anon.post("/api/auth/token/", {"username": "alice", "password": "wrong"}, format="json")
    assert r.status_code == 400 and "token" not in r.json()
    anon.credentials(HTTP_AUTHORIZATION=f"Token {alice.auth_token.key}")
    assert anon.get("/api/jobs/").status_code == 200


def test_session_auth_also_works(client, alice):
    client.force_login(alice)
    assert client.get("/api/datasets/").status_code == 200


def test_schema_and_docs(anon):
    r = anon.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert r.status_code == 200
    schema = r.json()
    paths = schema["paths"]
    for p in ["/api/datasets/", "/api/datasets/{id}/rows/", "/api/endpoints/{id}/health/", "/api/jobs/",
              "/api/jobs/{id}/export/", "/api/jobs/{job_id}/rollouts/", "/api/jobs/{job_id}/metrics/",
              "/api/jobs/{id}/retry-failed/", "/api/auth/token/"]:
        assert p in paths, p
    endpoint_props = schema["components"]["schemas"]["Endpoint"]["properties"]
    assert endpoint_props["api_key"].get("writeOnly") is True and endpoint_props["has_api_key"]["readOnly"] is True
    assert anon.get("/api/docs/").status_code == 200
    assert anon.get("/api/redoc/").status_code == 200
    assert reverse("api:docs") == "/api/docs/"


def test_unknown_api_path_is_json_404(api):
    r = api.get("/api/nothing/here/")
    assert r.status_code == 404 and r.json()["detail"]
    r = api.get("/api/jobs/99999999999999999999999/")
    assert r.status_code == 404 and r.json()["detail"]
    assert api.get("/api/jobs/-1/").status_code == 404


def test_throttled_per_user(api, bob_api, settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"user": "3/min", "anon": "3/min"}}
    codes = [api.get("/api/jobs/").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = api.get("/api/jobs/")
    assert r.status_code == 429 and "throttled" in r.json()["detail"].lower() and int(r["Retry-After"]) > 0
    assert bob_api.get("/api/jobs/").status_code == 200  # counted per user/token, not globally
