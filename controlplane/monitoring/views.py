"""/metrics and /healthz. Both are served by ProbeMiddleware (no host check, no HTTPS redirect, no session)."""
from __future__ import annotations

import hmac
import ipaddress
import time

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from rest_framework.throttling import BaseThrottle

from .database import PROBE_TIMEOUT_S, check_database

HEALTH_TIMEOUT_S = PROBE_TIMEOUT_S  # each part's answer: the database's and Redis'


def client_address(request) -> str:
    """The real client's address: X-Forwarded-For only as far as WEB_TRUSTED_PROXIES go (DRF's rule, the
    one the throttles use), else the peer."""
    return BaseThrottle().get_ident(request)


def metrics_allowed(request) -> bool:
    """A bearer token equal to METRICS_TOKEN, or a client inside METRICS_ALLOWED_NETWORKS (loopback by
    default). With the proxy in front, a public client is judged by its own address, never the proxy's."""
    token = getattr(settings, "METRICS_TOKEN", "")
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if token and header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip().encode(), token.encode()):
        return True
    try:
        address = ipaddress.ip_address(client_address(request).strip().split("%")[0])
    except ValueError:
        return False
    return any(address in ipaddress.ip_network(net, strict=False)
               for net in getattr(settings, "METRICS_ALLOWED_NETWORKS", []))


def metrics(request):
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET, HEAD"})
    if not metrics_allowed(request):
        return HttpResponse("metrics: not allowed from this address (METRICS_ALLOWED_NETWORKS) or without "
                            "'Authorization: Bearer <METRICS_TOKEN>'\n", status=403, content_type="text/plain")
    from .metrics import registry_for_scrape  # imported here: sets up the multi-process values on first use

    return HttpResponse(generate_latest(registry_for_scrape()), content_type=CONTENT_TYPE_LATEST)


def _check_redis() -> None:
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=HEALTH_TIMEOUT_S,
                                  socket_connect_timeout=HEALTH_TIMEOUT_S)
    try:
        client.ping()
    finally:
        client.close()


def healthz(request):
    """200 when the database and Redis (broker, channel layer, cache) answer, else 503 naming what failed.
    Open to anyone: it says ok or the failing part's error class, nothing more."""
    checks, healthy = {}, True
    for name, check in (("database", lambda: check_database(HEALTH_TIMEOUT_S)), ("redis", _check_redis)):
        t0 = time.perf_counter()
        try:
            check()
            checks[name] = {"ok": True, "ms": round((time.perf_counter() - t0) * 1000, 1)}
        except Exception as exc:  # noqa: BLE001 - any failure is the answer
            healthy = False
            checks[name] = {"ok": False, "error": type(exc).__name__}
    return JsonResponse({"ok": healthy, "checks": checks}, status=200 if healthy else 503)
