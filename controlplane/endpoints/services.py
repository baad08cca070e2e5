"""Endpoint domain logic: engine spec, health checks, pre-warm."""
from __future__ import annotations

from workers.engine.types import EndpointSpec


def endpoint_spec(endpoint) -> EndpointSpec:
    return EndpointSpec(
        base_urls=endpoint.all_base_urls,
        model=endpoint.model_name,
        api_flavor=endpoint.api_flavor,
        api_key=endpoint.api_key or None,
        request_timeout_s=endpoint.request_timeout_s,
        connect_timeout_s=endpoint.connect_timeout_s,
        max_retries=endpoint.max_retries,
        rpm_limit=endpoint.rpm_limit,
        tpm_limit=endpoint.tpm_limit,
    )
