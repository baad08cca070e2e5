"""Model-server operations ("ops": health, pre-warm, reset prefix cache, pause/resume, weight updates,
sleep/wake) through a dedicated HTTP client, timed as queue/rpc/wall per operation. Django-free."""
from .client import TRACE_HEADER, OpsClient, OpResult, new_trace_id, parse_server_timing

__all__ = ["OpsClient", "OpResult", "TRACE_HEADER", "new_trace_id", "parse_server_timing"]
