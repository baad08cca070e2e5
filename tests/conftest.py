"""Shared fixtures. Model-server fixtures live in their own plugin modules."""
pytest_plugins = ["tests.fixtures_simulator", "tests.fixtures_vllm", "tests.fixtures_nemo_gym"]
