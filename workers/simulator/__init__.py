"""A vLLM-compatible simulator: `python -m workers.simulator --help`.

Library use: `from workers.simulator import SimConfig, create_app`.
"""
from .config import FAULT_TYPES, ConfigError, SimConfig
from .server import create_app

__all__ = ["SimConfig", "ConfigError", "FAULT_TYPES", "create_app"]
