"""The token endpoint's throttle and the login lockout key on the real client, whoever connects: compose's web
server trusts X-Forwarded-For from the proxy's fixed address only (it was `--forwarded-allow-ips *`), and the
app drops X-Forwarded-* from any other peer (WEB_TRUSTED_PROXY_ADDRS). A peer that is not the proxy (a worker's
container, a program a verifier runs) forging a new address per request is throttled all the same: against the
web server started with compose's own command line and environment, and in the app itself."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import redis
import yaml
from django.conf import settings as django_settings
from rest_framework.test import APIClient

from tests.dashboard.servers import Proc, database_url, free_port

REPO = Path(__file__).resolve().parents[2]
PUBLIC_HOST = "cp.example.com"


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker" / "compose.yml").read_text())


def _subst(value) -> str:
    """${VAR:-default} as compose reads it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def _web():
    c = _compose()
    web, proxy = c["services"]["web"], c["services"]["proxy"]
    command = [_subst(a) for a in web["command"]]
    env = {k: _subst(v) for k, v in web["environment"].items() if not str(k).startswith("<<")}
    proxy_addr = _subst(((proxy.get("networks") or {}).get("default") or {}).get("ipv4_address"))
    return c, command, env, proxy_addr


def test_compose_trusts_forwarded_headers_from_the_proxy_alone():
    c, command, env, proxy_addr = _web()
    allowed = command[command.index("--forwarded-allow-ips") + 1]
    assert allowed != "*" and allowed == proxy_addr, allowed
    assert env["WEB_TRUSTED_PROXIES"] == "1" and env["WEB_TRUSTED_PROXY_ADDRS"] == proxy_addr
    ipam = c["networks"]["default"]["ipam"]["config"][0]
    subnet, dynamic = ipaddress.ip_network(_subst(ipam["subnet"])), ipaddress.ip_network(_subst(ipam["ip_range"]))
    addr = ipaddress.ip_address(proxy_addr)
    assert addr in subnet and addr not in dynamic  # no other container can be handed the proxy's address


def _attempt(url, forged) -> int:
    req = urllib.request.Request(url + "/api/auth/token/", data=json.dumps({"username": "mallory", "password": "x"}).encode(),
                                 method="POST", headers={"Host": PUBLIC_HOST, "X-Forwarded-Proto": "https",
                                                         "X-Forwarded-For": forged, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_compose_web_server_throttles_a_peer_that_forges_its_address(tmp_path):
    """compose's uvicorn command and web environment, production settings; this test is a peer on the network
    that is not the proxy, sending a new X-Forwarded-For with every failed token request."""
    _, command, web_env, _ = _web()
    port = free_port()
    command[command.index("--host") + 1], command[command.index("--port") + 1] = "127.0.0.1", str(port)
    prefix = f"cp-xff-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.update(web_env)
    env.update({"DJANGO_SETTINGS_MODULE": "controlplane.settings_production", "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
                "DJANGO_ALLOWED_HOSTS": PUBLIC_HOST, "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "WARNING",
                "DATABASE_URL": database_url(django_settings.DATABASES["default"]), "REDIS_URL": django_settings.REDIS_URL,
                "CACHE_KEY_PREFIX": prefix, "API_THROTTLE_ANON_RATE": "3/min",
                # this peer is not the proxy, so its X-Forwarded-Proto is dropped too: no redirect to https
                "DJANGO_SECURE_SSL_REDIRECT": "false",
                "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")})
    (tmp_path / "prom").mkdir()
    command[0] = str(REPO / ".venv" / "bin" / "uvicorn")
    web = Proc("uvicorn-compose", command, env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 40
        while True:
            assert web.proc.poll() is None, web.output()
            try:
                urllib.request.urlopen(url + "/healthz", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, web.output()
                time.sleep(0.2)
        codes = [_attempt(url, f"203.0.113.{i}") for i in range(6)]
        assert codes == [400, 400, 400, 429, 429, 429], codes  # one client, however it calls itself
    finally:
        web.stop()
        r = redis.Redis.from_url(django_settings.REDIS_URL)
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)


@pytest.mark.django_db
def test_the_app_takes_forwarded_for_from_the_proxy_only(settings, django_user_model):
    django_user_model.objects.create_user(username="mallory", password="pw-mallory-123")
    settings.WEB_TRUSTED_PROXIES = 1
    settings.WEB_TRUSTED_PROXY_ADDRS = ["172.28.0.10"]
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1,
                               "DEFAULT_THROTTLE_RATES": {"user": "1000/min", "anon": "3/min"}}
    c = APIClient()

    def attempt(peer, forged):
        return c.post("/api/auth/token/", {"username": "mallory", "password": "wrong"}, format="json",
                      REMOTE_ADDR=peer, HTTP_X_FORWARDED_FOR=forged).status_code

    # another container on the network, a new address each time: one client all the same
    assert [attempt("172.28.0.200", f"10.0.0.{i}") for i in range(5)] == [400, 400, 400, 429, 429]
    # through the proxy, its X-Forwarded-For is the client: three other clients are not throttled by those
    assert [attempt("172.28.0.10", f"198.51.100.{i}") for i in range(3)] == [400, 400, 400]
