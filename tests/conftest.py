"""Shared fixtures. Server fixtures (simulator, real vLLM) live in tests/servers.py."""
pytest_plugins = ["tests.servers"]
