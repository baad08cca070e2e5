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


@pytest.fixture
def silent_database():
    """An address that accepts TCP and never answers (a hung database host, or a proxy in front of a dead one):
    the kernel completes the handshakes, nothing reads."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.slow
@pytest.mark.parametrize("down", ["closed port", "silent listener"])
def test_database_down_reported_by_healthz_and_metrics_within_seconds(tmp_path, down, silent_database):
    """A process whose PostgreSQL does not answer: /healthz 503 naming the database, /metrics still answers with
    controlplane_database_up 0 (Prometheus sees the outage, not a failed scrape), each within the probe's 2 s bound
    plus the process's own time: not the connection pool's 30 s wait per query (30 s and 60 s before), past any
    orchestrator's probe and Prometheus' scrape timeout."""
    port = _closed_port() if down == "closed port" else silent_database
    code = ("import json, time; from django.test import Client; c = Client(); t = time.monotonic(); "
            "h = c.get('/healthz'); t_h = time.monotonic() - t; t = time.monotonic(); m = c.get('/metrics'); "
            "t_m = time.monotonic() - t; "
            "print(json.dumps([h.status_code, h.json(), m.status_code, m.content.decode(), t_h, t_m]))")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
           "DATABASE_URL": f"postgres://postgres@127.0.0.1:{port}/nothing"}
    r = subprocess.run([sys.executable, "-c", "import django; django.setup(); " + code], cwd=Path(__file__).parents[2],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    h_status, h_body, m_status, m_text, healthz_s, metrics_s = json.loads(r.stdout.strip().splitlines()[-1])
    assert h_status == 503 and h_body["checks"]["database"] == {"ok": False, "error": "OperationalError"}
    assert h_body["checks"]["redis"]["ok"] is True
    assert m_status == 200 and "controlplane_database_up 0.0" in m_text and "controlplane_jobs{" not in m_text
    assert healthz_s < 6 and metrics_s < 6, (healthz_s, metrics_s)
