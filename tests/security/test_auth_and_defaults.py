"""Logins and throttles key on the real client; production settings refuse insecure defaults; pages carry
security headers and the API docs load no third-party script."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import pytest
from pathlib import Path

from django.test import Client
from rest_framework.test import APIClient

REPO = Path(__file__).resolve().parents[2]


def test_token_throttle_ignores_a_client_supplied_forwarded_for(db, settings, mallory):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                               "DEFAULT_THROTTLE_RATES": {"user": "1000/min", "anon": "3/min"}}
    c = APIClient()
    codes = [c.post("/api/auth/token/", {"username": "mallory", "password": "wrong"}, format="json",
                    HTTP_X_FORWARDED_FOR=f"10.0.0.{i}").status_code for i in range(5)]
    assert codes[:3] == [400, 400, 400] and codes[3:] == [429, 429], codes


def test_repeated_failed_logins_lock_the_account_out_on_pages_and_api(db, settings, mallory):
    settings.AXES_FAILURE_LIMIT = 3
    web = Client()
    codes = [web.post("/accounts/login/", {"username": "mallory", "password": "guess"}).status_code for _ in range(3)]
    assert codes == [200, 200, 429]  # the form again, then locked at the limit
    r = web.post("/accounts/login/", {"username": "mallory", "password": "pw-mallory-123"})
    assert r.status_code == 429  # locked: even the right password is refused for the cool-off
    r = APIClient().post("/api/auth/token/", {"username": "mallory", "password": "pw-mallory-123"}, format="json")
    assert r.status_code in (400, 403, 429) and "token" not in r.json()


def test_token_endpoint_still_gives_tokens(db, mallory):
    r = APIClient().post("/api/auth/token/", {"username": "mallory", "password": "pw-mallory-123"}, format="json")
    assert r.status_code == 200 and len(r.json()["token"]) >= 40


def test_tokens_are_not_readable_in_the_admin(db, django_user_model):
    admin_user = django_user_model.objects.create_superuser("boss", "b@example.com", "pw-boss-12345")
    c = Client()
    c.force_login(admin_user)
    assert c.get("/admin/authtoken/tokenproxy/").status_code == 404


def _production(extra_env: dict, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.update({"DJANGO_SETTINGS_MODULE": "controlplane.settings_production", "DJANGO_ALLOWED_HOSTS": "cp.example.com",
                **extra_env})
    return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_production_settings_refuse_the_default_secret_key():
    r = _production({}, "check")
    assert r.returncode != 0 and "DJANGO_SECRET_KEY must be set" in r.stderr
    r = _production({"DJANGO_SECRET_KEY": "insecure-laptop-default-change-me-in-production"}, "check")
    assert r.returncode != 0 and "DJANGO_SECRET_KEY must be set" in r.stderr


@pytest.mark.slow
def test_production_settings_pass_check_deploy():
    r = _production({"DJANGO_SECRET_KEY": secrets.token_urlsafe(64)}, "check", "--deploy", "--fail-level", "WARNING")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no issues" in r.stdout


def test_security_headers_and_local_docs_scripts(db, mallory):
    c = Client()
    c.force_login(mallory)
    r = c.get("/")
    csp = r["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
    assert r["X-Content-Type-Options"] == "nosniff" and r["X-Frame-Options"] == "DENY"
    docs = c.get("/api/docs/")
    html = docs.content.decode()
    assert docs.status_code == 200 and "cdn" not in html.lower() and "unpkg" not in html.lower()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in html
    assert "<script>" not in html.replace(" ", "")  # no inline script the CSP would block
