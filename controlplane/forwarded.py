"""X-Forwarded-* headers count only when the proxy sent them. Throttles (DRF, NUM_PROXIES), login lockouts
(django-axes) and /metrics read the client's address from X-Forwarded-For when WEB_TRUSTED_PROXIES says a
proxy is in front; any other peer on the network (a worker's container, a program a verifier runs) could
forge it and get a fresh address for every request. So the headers are dropped unless the request came from
one of WEB_TRUSTED_PROXY_ADDRS (compose: Caddy's fixed address); the peer's own address is then the client's."""
from __future__ import annotations

import ipaddress

from django.conf import settings

FORWARDED_HEADERS = ("HTTP_X_FORWARDED_FOR", "HTTP_X_FORWARDED_PROTO", "HTTP_X_FORWARDED_HOST",
                     "HTTP_X_FORWARDED_PORT", "HTTP_FORWARDED")


def from_trusted_proxy(remote_addr: str) -> bool:
    try:
        ip = ipaddress.ip_address((remote_addr or "").split("%")[0])
    except ValueError:
        return False
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return any(ip in ipaddress.ip_network(n, strict=False) for n in settings.WEB_TRUSTED_PROXY_ADDRS)


class TrustedProxyMiddleware:
    """First in MIDDLEWARE: what follows sees X-Forwarded-* only from a trusted proxy."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        meta = request.META
        if any(h in meta for h in FORWARDED_HEADERS) and not (
                settings.WEB_TRUSTED_PROXIES and from_trusted_proxy(meta.get("REMOTE_ADDR", ""))):
            for h in FORWARDED_HEADERS:
                meta.pop(h, None)
        return self.get_response(request)
