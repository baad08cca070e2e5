"""Token auth, anonymous access (401 on every route), the schema and docs pages, JSON 404s, throttling."""
from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

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
    assert r.status_code == 200
    token = r.json()["token"]
    assert len(token) == 64 and token != alice.api_token  # a new token per login; the older one still works
    expiry = datetime.fromisoformat(r.json()["expiry"])
    assert timedelta(days=29) < expiry - timezone.now() <= timedelta(days=30)
    r = anon.post("/api/auth/token/", {"username": "alice", "password": "wrong"}, format="json")
    assert r.status_code == 400 and "token" not in r.json()
    for t in (token, alice.api_token):
        anon.credentials(HTTP_AUTHORIZATION=f"Token {t}")
        assert anon.get("/api/jobs/").status_code == 200


def test_tokens_are_stored_hashed(anon, alice, bob):
    """No column of any row holds a token: knox keeps a SHA-512 digest and a 15-character lookup prefix."""
    from django.db import connection

    token = anon.post("/api/auth/token/", {"username": "alice", "password": "pw-alice"}, format="json").json()["token"]
    tables = [t for t in connection.introspection.table_names() if "token" in t]
    assert tables == ["knox_authtoken"]
    with connection.cursor() as cur:
        cur.execute("SELECT * FROM knox_authtoken")
        cells = [str(c) for row in cur.fetchall() for c in row]
    assert len(cells) == 3 * 5  # alice's fixture token, bob's, the one just obtained
    for t in (token, alice.api_token, bob.api_token):
        assert not any(t in c for c in cells)
        assert hashlib.sha512(t.encode()).hexdigest() in cells


def test_an_expired_token_is_refused_with_a_clear_401(anon, alice):
    from knox.models import AuthToken

    anon.credentials(HTTP_AUTHORIZATION=f"Token {alice.api_token}")
    assert anon.get("/api/jobs/").status_code == 200
    AuthToken.objects.filter(user=alice).update(expiry=timezone.now() - timedelta(seconds=1))
    r = anon.get("/api/jobs/")
    assert r.status_code == 401 and r["WWW-Authenticate"].startswith("Token")
    assert r.json()["detail"].startswith("Token expired") and "/api/auth/token/" in r.json()["detail"]
    assert not AuthToken.objects.filter(user=alice).exists()  # expired tokens are deleted on sight
    assert anon.get("/api/jobs/").json()["detail"] == "Invalid token."


def test_logout_revokes_only_the_token_it_was_sent_with(anon, alice):
    second = anon.post("/api/auth/token/", {"username": "alice", "password": "pw-alice"}, format="json").json()["token"]
    anon.credentials(HTTP_AUTHORIZATION=f"Token {second}")
    assert anon.delete("/api/auth/token/").status_code == 204
    assert anon.get("/api/jobs/").status_code == 401
    anon.credentials(HTTP_AUTHORIZATION=f"Token {alice.api_token}")
    assert anon.get("/api/jobs/").status_code == 200
    anon.credentials()
    assert anon.delete("/api/auth/token/").status_code == 401


def test_existing_drf_tokens_are_migrated_hashed(alice):
    """A database from before knox: its plaintext DRF tokens keep working, hashed, and the plaintext is gone."""
    import importlib

    from django.apps import apps
    from django.db import connection

    migration = importlib.import_module("controlplane.api.migrations.0001_apischema_hash_drf_tokens")
    legacy = "0123456789abcdef0123456789abcdef01234567"  # a DRF key: 40 hex characters
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamptz NOT NULL,"
                    " user_id integer NOT NULL)")
        cur.execute("INSERT INTO authtoken_token VALUES (%s, now(), %s)", [legacy, alice.pk])
    with connection.schema_editor() as editor:
        migration.hash_drf_tokens(apps, editor)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM authtoken_token")
        assert cur.fetchone()[0] == 0
        cur.execute("SELECT digest, token_key FROM knox_authtoken WHERE digest = %s",
                    [hashlib.sha512(legacy.encode()).hexdigest()])
        assert cur.fetchall() == [(hashlib.sha512(legacy.encode()).hexdigest(), legacy[:15])]
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {legacy}")
    assert c.get("/api/jobs/").status_code == 200


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


def test_a_request_reads_only_the_presented_token_and_a_login_purges_the_expired(anon, alice):
    """Authentication costs one query however many tokens the user holds (knox would read them all on each
    request); the user's expired tokens go when a new one is issued, and the live ones stay."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from knox.models import AuthToken
    from knox.settings import CONSTANTS

    from controlplane.api.auth import issue_token
    from controlplane.rest.authentication import ExpiringTokenAuthentication

    for _ in range(3):
        issue_token(alice)
    old = AuthToken.objects.filter(user=alice).exclude(token_key=alice.api_token[:CONSTANTS.TOKEN_KEY_LENGTH])[:2]
    AuthToken.objects.filter(pk__in=[t.pk for t in old]).update(expiry=timezone.now() - timedelta(seconds=1))
    with CaptureQueriesContext(connection) as q:
        user, _ = ExpiringTokenAuthentication().authenticate_credentials(alice.api_token.encode())
    assert user == alice and len(q.captured_queries) == 1, [x["sql"] for x in q.captured_queries]
    assert AuthToken.objects.filter(user=alice).count() == 4  # the expired two are not touched by a request
    r = anon.post("/api/auth/token/", {"username": "alice", "password": "pw-alice"}, format="json")
    assert r.status_code == 200
    live = AuthToken.objects.filter(user=alice)
    assert live.count() == 3 and all(t.expiry > timezone.now() for t in live)
