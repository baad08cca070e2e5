"""Who may read /metrics, and what /healthz says when a part is down (a real closed port, no mock)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.django_db
def test_metrics_allow_list_and_token(settings):
    settings.METRICS_TOKEN = "s3cret-scrape-token"
    c = Client()
    assert c.get("/metrics").status_code == 200  # loopback: the default allow-list
    assert c.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 403
    assert c.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
    r = c.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer s3cret-scrape-token")
    assert r.status_code == 200 and b"controlplane_jobs{" in r.content
    settings.METRICS_ALLOWED_NETWORKS = ["10.0.0.0/8"]
    assert c.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    assert c.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 403
    assert c.post("/metrics").status_code == 405


@pytest.mark.django_db
def test_metrics_behind_the_proxy_judge_the_real_client(settings):
    """With one trusted proxy, the client's own address decides: a forged X-Forwarded-For entry is not it."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
    c = Client()
    assert c.get("/metrics", REMOTE_ADDR="172.18.0.5", HTTP_X_FORWARDED_FOR="127.0.0.1, 203.0.113.7").status_code == 403
    assert c.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="127.0.0.1").status_code == 200


@pytest.mark.django_db
def test_probes_skip_host_checks_and_the_https_redirect(settings):
    """Production-like: only the public name allowed and HTTPS forced; a probe by the container's name over
    HTTP still gets its answer, a page does not."""
    settings.ALLOWED_HOSTS = ["cp.example.com"]
    settings.SECURE_SSL_REDIRECT = True
    c = Client()
    assert c.get("/healthz", HTTP_HOST="web:8000").status_code == 200
    assert c.get("/metrics", HTTP_HOST="web:8000").status_code == 200
    assert c.get("/accounts/login/", HTTP_HOST="web:8000").status_code == 400


@pytest.mark.django_db
def test_healthz_reports_redis_down(settings):
    c = Client()
    r = c.get("/healthz")
    assert r.status_code == 200 and r.json()["checks"]["database"]["ok"] and r.json()["checks"]["redis"]["ok"]
    settings.REDIS_URL = f"redis://127.0.0.1:{_closed_port()}/0"
    r = c.get("/healthz")
    body = r.json()
    assert r.status_code == 503 and body["ok"] is False
    assert body["checks"]["redis"] == {"ok": False, "error": "ConnectionError"}
    assert body["checks"]["database"]["ok"] is True


@pytest.mark.slow
def test_database_down_reported_by_healthz_and_metrics(tmp_path):
    """A process whose PostgreSQL does not answer (a closed port): /healthz 503 naming the database,
    /metrics still answers with controlplane_database_up 0 (Prometheus sees the outage, not a failed scrape)."""
    code = ("import json; from django.test import Client; c = Client(); h = c.get('/healthz'); m = c.get('/metrics'); "
            "print(json.dumps([h.status_code, h.json(), m.status_code, m.content.decode()]))")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "DATABASE_URL": f"postgres://postgres@127.0.0.1:{_closed_port()}/nothing"}
    r = subprocess.run([sys.executable, "-c", "import django; django.setup(); " + code], cwd=Path(__file__).parents[2],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    h_status, h_body, m_status, m_text = json.loads(r.stdout.strip().splitlines()[-1])
    assert h_status == 503 and h_body["checks"]["database"] == {"ok": False, "error": "OperationalError"}
    assert h_body["checks"]["redis"]["ok"] is True
    assert m_status == 200 and "controlplane_database_up 0.0" in m_text and "controlplane_jobs{" not in m_text
