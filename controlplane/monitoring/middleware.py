"""Answers GET /healthz and /metrics first in the middleware stack.

Container health checks and Prometheus reach a web process by its internal name (`web:8000`) over plain
HTTP; production settings would refuse that host name (ALLOWED_HOSTS holds the public one) and redirect
to HTTPS. These two answers build no URL from the Host header, so skipping those checks is safe; /metrics
has its own access rule (views.metrics_allowed)."""
from __future__ import annotations

from . import views

PROBES = {"/healthz": views.healthz, "/metrics": views.metrics}


class ProbeMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        probe = PROBES.get(request.path_info)
        if probe is not None:
            return probe(request)
        return self.get_response(request)
