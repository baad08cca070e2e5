"""Reuse the controlplane fixtures (user, math_dataset, sim_endpoint)."""
from tests.controlplane.conftest import math_dataset, sim_endpoint, user  # noqa: F401
