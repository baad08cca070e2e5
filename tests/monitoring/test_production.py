"""Production settings, as docker/compose.yml runs them: two uvicorn web processes share ONE set of DRF
throttle counters through the Redis cache (with the laptop's per-process memory cache each would allow the
full rate), and /healthz answers a probe by the container's internal name over plain HTTP."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings as django_settings

from tests.dashboard.servers import Proc, database_url, free_port, web_command

REPO = Path(__file__).resolve().parents[2]
PUBLIC_HOST = "cp.example.com"


def _production_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.update({"DJANGO_SETTINGS_MODULE": "controlplane.settings_production", "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
                "DJANGO_ALLOWED_HOSTS": PUBLIC_HOST, "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "WARNING",
                "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"), **extra})
    return env


def _start(env) -> tuple[Proc, str]:
    port = free_port()
    p = Proc("uvicorn-prod", web_command("uvicorn", port), env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        assert p.proc.poll() is None, p.output()
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:  # no Host / https needed for probes
                assert json.loads(r.read())["ok"] is True
                return p, url
        except OSError:
            time.sleep(0.2)
    p.stop()
    raise AssertionError("web did not answer /healthz: " + p.output())


def _token_attempt(url) -> int:
    """A failed token request as the proxy forwards it: public Host, https, the client's address appended."""
    req = urllib.request.Request(url + "/api/auth/token/", data=json.dumps({"username": "nobody", "password": "x"}).encode(),
                                 method="POST", headers={"Host": PUBLIC_HOST, "X-Forwarded-Proto": "https",
                                                         "X-Forwarded-For": "198.51.100.7",
                                                         "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_two_web_processes_share_throttle_limits_through_redis(tmp_path):
    prefix = f"cp-test-{uuid.uuid4().hex[:8]}"
    redis_url = django_settings.REDIS_URL
    env = _production_env(tmp_path, DATABASE_URL=database_url(django_settings.DATABASES["default"]),
                          REDIS_URL=redis_url, CACHE_KEY_PREFIX=prefix, API_THROTTLE_ANON_RATE="3/min",
                          WEB_TRUSTED_PROXIES="1")
    servers = []
    try:
        servers = [_start(env), _start(env)]
        (_, a), (_, b) = servers
        codes = [_token_attempt(url) for url in (a, b, a, b, a, b)]
        # 3 per minute in all, not 3 per process: the 4th request, whichever process gets it, is refused
        assert codes == [400, 400, 400, 429, 429, 429], codes
        # the counter is one key in Redis, under this deployment's prefix
        r = redis.Redis.from_url(redis_url, socket_timeout=5)
        keys = [k.decode() for k in r.scan_iter(f"{prefix}:*")]
        assert keys == [f"{prefix}:1:throttle_anon_198.51.100.7"], keys
        r.delete(*keys)
        # a page by the internal name over plain HTTP is refused (host check), the probe is not
        req = urllib.request.Request(a + "/accounts/login/", headers={"X-Forwarded-Proto": "https"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 400
    finally:
        for p, _ in servers:
            p.stop()


@pytest.mark.slow
def test_production_settings_use_redis_for_the_cache_and_throttles(tmp_path):
    """The settings as a deployment loads them: cache on Redis, DRF throttles on that cache, DEBUG off,
    Secure cookies, HSTS, and `check --deploy` clean (warnings fail it)."""
    code = ("from django.conf import settings as s; from django.core.cache import cache; "
            "from rest_framework.throttling import SimpleRateThrottle as T; import json; "
            "print(json.dumps([s.CACHES['default']['BACKEND'], T.cache is cache or T.cache._alias, s.DEBUG, "
            "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS, s.SECURE_SSL_REDIRECT]))")
    env = _production_env(tmp_path)
    r = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    backend, throttle_cache, debug, session_secure, csrf_secure, hsts, ssl_redirect = json.loads(r.stdout.strip().splitlines()[-1])
    assert backend == "django.core.cache.backends.redis.RedisCache"
    assert throttle_cache in (True, "default")
    assert (debug, session_secure, csrf_secure, ssl_redirect) == (False, True, True, True) and hsts >= 31536000
    r = subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "no issues" in r.stdout, r.stdout + r.stderr
