"""Fixtures that start model servers on loopback for tests (filled in by the model-server work)."""
